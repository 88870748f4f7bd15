"""Text ↔ token ids for one checkpoint: encoding, decoding, chat templates, streaming detokenization.

A checkpoint's `tokenizer.json` is loaded with `tokenizers` (no Python tokenizer classes, no
remote code); `tokenizer_config.json`, `generation_config.json` and `config.json` add the
special tokens, the chat template and the EOS ids. Chat templates are untrusted code and run
in Jinja's immutable sandbox, with the helpers Hugging Face templates expect.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
import jinja2.utils
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import BatonError, CheckpointError

logger = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE_PATH = Path(__file__).resolve().parent / "assets" / "chat_template.jinja"

# Hugging Face's "no limit" sentinel for model_max_length is int(1e30).
_UNBOUNDED_MAX_LENGTH = 10**12
_REPLACEMENT_CHAR = "\ufffd"


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


# --- chat templates ---------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}…{% endgeneration %}` marks assistant text; we just render it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        body: list[jinja2.nodes.Node] = parser.parse_statements(
            ("name:endgeneration",), drop_needle=True
        )
        return body


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, failing at once on an unsafe attribute instead of returning an
    undefined that renders as empty text (so a probing template is an error, not a no-op)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__} is not allowed"
        )


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, as Hugging Face's does."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; HF templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; rendering errors become BatonError with the template's message."""

    def __init__(self, source: str) -> None:
        env = _StrictSandbox(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.globals["namespace"] = _TemplateNamespace
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise BatonError(
                f"chat template is invalid (line {exc.lineno}): {exc.message}"
            ) from None

    def render(self, variables: Mapping[str, Any]) -> str:
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.SecurityError as exc:
            raise BatonError(f"chat template tried an unsafe operation: {exc}") from None
        except jinja2.TemplateError as exc:
            raise BatonError(f"chat template failed: {exc.message}") from None
        except Exception as exc:  # a template is arbitrary code: any failure is the template's
            raise BatonError(f"chat template failed: {type(exc).__name__}: {exc}") from None


# --- streaming detokenization ----------------------------------------------------------------

# Prompt tokens decoded as context before the first output token (leading-space rules).
_PROMPT_CONTEXT_TOKENS = 4
# Held-back tokens after which the window is cut (only undecodable byte runs get here).
_MAX_HELD_TOKENS = 8
# Cut points tried: an unfinished UTF-8 character spans at most 3 bytes, so 3 byte tokens.
_MAX_CUT_LOOKBACK = 4
# A window that cannot be cut cleanly (text-less tokens inside an unfinished character) is
# emitted as it decodes once it reaches this size, keeping each push bounded.
_MAX_WINDOW_TOKENS = 64


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a UTF-8 character.

    It decodes a small window of ids per token (the prefix-offset/read-offset scheme of vLLM
    and TGI). The window's first `read_offset` ids are context whose text, `prefix`, was
    returned earlier; decoding them again makes leading-space rules (sentencepiece's "▁")
    come out as in a full decode:

        window: [ context ids | new ids ]      decode(window) = prefix + new text
                               ^ read_offset

    While the window's text ends in U+FFFD the new ids may be an unfinished character, so
    nothing is returned; once it ends cleanly the new text is returned and the new ids become
    the next context. The concatenated output equals the full decode, except that for an
    invalid byte sequence a byte-fallback decoder (which decodes a run of <0xNN> tokens as a
    whole) may show fewer U+FFFD than a full decode.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        prompt_ids: Sequence[int],
        is_skipped: Callable[[int], bool] = lambda token_id: False,
    ) -> None:
        self._decode = decode
        self._is_skipped = is_skipped
        self._ids: list[int] = list(prompt_ids[max(0, len(prompt_ids) - _PROMPT_CONTEXT_TOKENS) :])
        self._read_offset = len(self._ids)
        self._prefix = decode(self._ids) if self._ids else ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (usually its own text, maybe '')."""
        if self._is_skipped(token_id):
            return ""  # decode drops special tokens before its decoders see them
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if not text.endswith(_REPLACEMENT_CHAR):
            return self._take_all(text)
        if len(self._ids) - self._read_offset <= _MAX_HELD_TOKENS:
            return ""
        delta = self._cut(text)
        if delta is None and len(self._ids) > _MAX_WINDOW_TOKENS:
            delta = self._take_all(text)
        return delta or ""

    def flush(self) -> str:
        """The held-back text at the end of the stream, as the full decode shows it."""
        return self._take_all(self._decode(self._ids))

    def _take_all(self, text: str) -> str:
        """Return the window's new text and slide: the new ids become the next context."""
        delta = text[len(self._prefix) :]
        new_ids = self._ids[self._read_offset :]
        new_prefix = self._decode(new_ids) if new_ids else ""
        if new_prefix or self._read_offset == 0:
            self._ids, self._read_offset, self._prefix = new_ids, len(new_ids), new_prefix
        else:
            # The new ids have no text of their own (skipped special tokens, a lone "▁"), so
            # they cannot stand in as context: keep the old context and drop them.
            del self._ids[self._read_offset :]
        return delta

    def _cut(self, text: str) -> str | None:
        """Bound a window held back by a long undecodable run: return the text before a token
        boundary where decoding the two sides apart gives the same text (so no character is
        split there), and keep the rest, with the token before the cut as context."""
        lowest = max(self._read_offset + 1, len(self._ids) - _MAX_CUT_LOOKBACK)
        for cut in range(len(self._ids) - 1, lowest - 1, -1):
            context = self._decode(self._ids[cut - 1 : cut])
            tail_text = self._decode(self._ids[cut - 1 :])
            tail = tail_text[len(context) :]
            if not tail or not tail_text.startswith(context):
                continue
            head = self._decode(self._ids[:cut])
            if head + tail == text:
                self._ids = self._ids[cut - 1 :]
                self._read_offset = 1
                delta, self._prefix = head[len(self._prefix) :], context
                return delta
        return None
