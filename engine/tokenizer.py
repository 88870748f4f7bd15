"""Text ↔ token ids for one checkpoint: encoding, decoding, chat templates, streaming detokenization.

A checkpoint's `tokenizer.json` is loaded with `tokenizers` (no Python tokenizer classes, no
remote code); `tokenizer_config.json`, `generation_config.json` and `config.json` add the
special tokens, the chat template and the EOS ids. Chat templates are untrusted code and run
in Jinja's immutable sandbox, with the helpers Hugging Face templates expect.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.chat_template import ChatTemplate
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import CheckpointError

logger = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE_PATH = Path(__file__).resolve().parent / "assets" / "chat_template.jinja"

# Hugging Face's "no limit" sentinel for model_max_length is int(1e30).
_UNBOUNDED_MAX_LENGTH = 10**12


@dataclass(frozen=True, slots=True)
class TokenizerSettings:
    """What the JSON files beside tokenizer.json say about special tokens and templates."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    add_bos_token: bool | None = None  # None: whatever tokenizer.json's post-processor does
    chat_template: str | None = None
    model_max_length: int | None = None
    # From generation_config.json / config.json:
    eos_token_ids: tuple[int, ...] = ()
    config_bos_token_id: int | None = None  # used when tokenizer_config.json names no BOS


class Tokenizer:
    """One checkpoint's tokenizer. Build it with `Tokenizer.from_dir`."""

    def __init__(self, backend: HFTokenizer, settings: TokenizerSettings) -> None:
        self._backend = backend
        self.settings = settings
        self._special_ids = frozenset(
            token_id
            for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        )
        self.bos_token_id = self._token_id(settings.bos_token)
        if self.bos_token_id is None and settings.bos_token is None:
            self.bos_token_id = settings.config_bos_token_id
        self.eos_token_ids = self._collect_eos_ids(settings)
        # Whether tokenizer.json's post-processor already adds BOS (Llama-style templates).
        self._post_adds_bos = self.bos_token_id is not None and backend.encode(
            "", add_special_tokens=True
        ).ids[:1] == [self.bos_token_id]
        bos = backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None
        self._special_tokens = {
            "bos_token": settings.bos_token or bos or "",
            "eos_token": settings.eos_token or "",
            "unk_token": settings.unk_token or "",
            "pad_token": settings.pad_token or "",
        }
        template = settings.chat_template
        if template is None:
            template = DEFAULT_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
        self._chat_template = ChatTemplate(template)

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{tokenizer_file} is missing: baton needs a fast tokenizer")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust loader raises a bare Exception
            raise CheckpointError(f"{tokenizer_file} cannot be loaded: {exc}") from None
        return cls(backend, read_settings(directory))

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def model_max_length(self) -> int | None:
        return self.settings.model_max_length

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. A prompt rendered by a chat template usually carries its BOS
        already: encode it with add_special_tokens=False."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens or self.bos_token_id is None:
            return ids
        if self.settings.add_bos_token and not self._post_adds_bos:
            return [self.bos_token_id, *ids]
        if self.settings.add_bos_token is False and self._post_adds_bos:
            return ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's own string in the vocabulary (byte-level BPE's `Ġ` and all: what
        Hugging Face's convert_ids_to_tokens gives); "" for an id the vocabulary lacks."""
        return [self._backend.id_to_token(i) or "" for i in ids]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render a conversation into prompt text (HF conventions; `extra` e.g. tools=...)."""
        variables = {**self._special_tokens, **extra}
        variables.update(messages=messages, add_generation_prompt=add_generation_prompt)
        return self._chat_template.render(variables)

    def to_json(self) -> str:
        """tokenizer.json's content (padding and truncation off), for the grammar matcher."""
        backend = copy.copy(self._backend)
        backend.no_padding()
        backend.no_truncation()
        text: str = backend.to_str()
        return text

    def new_detokenizer(self, prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decode, prompt_ids, self.is_special)

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        return int(token_id) if token_id is not None else None

    def _collect_eos_ids(self, settings: TokenizerSettings) -> tuple[int, ...]:
        ids = list(settings.eos_token_ids)
        tokenizer_eos = self._token_id(settings.eos_token)
        if tokenizer_eos is not None:
            ids.append(tokenizer_eos)
        vocab_size = self.vocab_size
        out_of_range = [i for i in ids if not 0 <= i < vocab_size]
        if out_of_range:
            logger.warning("ignoring EOS ids outside the vocabulary: %s", out_of_range)
        return tuple(dict.fromkeys(i for i in ids if 0 <= i < vocab_size))


# --- reading the JSON files beside tokenizer.json -------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return value


def _token_text(value: object, path: Path, key: str) -> str | None:
    """A special token is written either as its text or as an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise CheckpointError(f"{path}: {key} must be a string or an object with 'content'")


def _chat_template_text(value: object, path: Path) -> str | None:
    """HF stores one template as a string, or several as [{"name", "template"}]."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        template = named.get("default")
        if isinstance(template, str):
            return template
        raise CheckpointError(f"{path}: chat_template lists no template named 'default'")
    raise CheckpointError(f"{path}: chat_template must be a string or a list of named templates")


def _id_list(value: object) -> list[int]:
    """An id field that is an int or a list of ints (eos_token_id often is a list)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def read_settings(directory: Path) -> TokenizerSettings:
    config_path = directory / "tokenizer_config.json"
    config = _read_json(config_path)
    template = _chat_template_text(config.get("chat_template"), config_path)
    template_file = directory / "chat_template.jinja"  # newer transformers save it separately
    if template is None and template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    max_length = config.get("model_max_length")
    if not isinstance(max_length, int) or isinstance(max_length, bool):
        max_length = None
    elif max_length >= _UNBOUNDED_MAX_LENGTH:
        max_length = None
    add_bos = config.get("add_bos_token")
    generation = _read_json(directory / "generation_config.json")
    model_config = _read_json(directory / "config.json")
    eos_ids = _id_list(generation.get("eos_token_id")) + _id_list(model_config.get("eos_token_id"))
    bos_ids = _id_list(generation.get("bos_token_id")) + _id_list(model_config.get("bos_token_id"))
    return TokenizerSettings(
        bos_token=_token_text(config.get("bos_token"), config_path, "bos_token"),
        eos_token=_token_text(config.get("eos_token"), config_path, "eos_token"),
        unk_token=_token_text(config.get("unk_token"), config_path, "unk_token"),
        pad_token=_token_text(config.get("pad_token"), config_path, "pad_token"),
        add_bos_token=add_bos if isinstance(add_bos, bool) else None,
        chat_template=template,
        model_max_length=max_length,
        eos_token_ids=tuple(eos_ids),
        config_bos_token_id=bos_ids[0] if bos_ids else None,
    )
