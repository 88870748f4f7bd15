"""Deterministic prompt material: a prompt is a tuple of parts, rendered as token ids or text.

A `Segment(key, num_tokens)` is a run of tokens that depends only on its key: the same key
always gives the same tokens, and a shorter segment with the same key is a prefix of a longer
one (SHAKE-256 output is prefix-stable), which is what makes a partial trace block a prefix
of the full block. An `Output` is what the server actually generated for an earlier turn.

    parts:   [Segment("s/rag/system", 2000)] [Segment("s/rag/q/7", 50)]
    tokens:  [ 9812, 301, ... 2,000 ids ... ][ 4410, ... 50 ids ... ]
    text:    " return value self ... 2,000 words"" parser node ... 50 words"

Token mode is exact. Text mode draws words that are each one token of baton-tiny's byte-level
BPE when preceded by a space (a test checks this), and every word carries its own leading
space, so on that tokenizer a segment of n words is exactly n tokens and segments concatenate
on token boundaries; on other tokenizers the count is approximate. SHAKE-256 rather than a
seeded RNG because it is the same on every Python and numpy version.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Protocol

import numpy as np

# Each word is a single token (with its leading space) in baton-tiny's tokenizer.
WORDS: tuple[str, ...] = tuple(
    """self def the test for return with and not name file import class str raise else that
    value pass try sys set get from except arg are data code result type object line list this
    time module call check len out can text expected path string method new other sub key int
    range should msg error argument spec function default has print run will encoding char all
    args elif when add read support mock size socket assert open start format context use log
    bytes base but del end thread case have used message foo which server doc must err output
    does parser one match create async tests any number filename header only sign dict event
    tuple first iter source func instance obj finally local mode state zip node yield values
    last while break version make command loop await max was next conn called may pos close
    some frame exec over option current warnings attr url lambda lines input item dir work root
    errors off byte pack super files same given bar after cmd block temp stream fail float help
    child names global types change config multi handler using prefix write handle client
    compile user count than follow there need group continue index token into copy part empty
    objects then allow order repr methods signal process encode stdout offset more flags
    example before its timeout stack old also script pattern results per buffer element target
    date parent wrap content http min two found hash back decode sure memory package extra
    request response page cache model prompt queue""".split()
)

# Ids below this are left out: special tokens and the byte-fallback range sit at the bottom
# of the vocabularies baton and its peers use.
MIN_TOKEN_ID = 100


class PromptMode(Enum):
    TOKENS = "tokens"
    TEXT = "text"


@dataclass(frozen=True, slots=True)
class Segment:
    """`num_tokens` tokens determined by `key` alone."""

    key: str
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Output:
    """A previous turn's generated text, and its token ids when the server returned them."""

    text: str
    token_ids: tuple[int, ...] | None


Part = Segment | Output


class Tokenizer(Protocol):
    """What text → ids needs (a `tokenizers.Tokenizer` adapted by `load_tokenizer`)."""

    def encode(self, text: str) -> list[int]: ...


class MissingTokenIds(RuntimeError):
    """Token mode needs a previous turn's output as ids, and neither the server nor a local
    tokenizer provided them."""


@lru_cache(maxsize=4096)
def _draws(key: str, n: int) -> tuple[int, ...]:
    """n uniform 32-bit draws determined by key (prefix-stable in n)."""
    raw = hashlib.shake_256(key.encode()).digest(4 * n)
    return tuple(np.frombuffer(raw, dtype="<u4").tolist())


def segment_ids(key: str, n: int, vocab_size: int) -> list[int]:
    """Token ids of Segment(key, n), drawn from [MIN_TOKEN_ID, vocab_size)."""
    span = vocab_size - MIN_TOKEN_ID
    if span <= 0:
        raise ValueError(f"vocab_size {vocab_size} must exceed {MIN_TOKEN_ID}")
    return [MIN_TOKEN_ID + d % span for d in _draws(key, n)]


def segment_text(key: str, n: int) -> str:
    """Text of Segment(key, n): n words, each with its leading space."""
    return "".join(" " + WORDS[d % len(WORDS)] for d in _draws(key, n))


@dataclass(frozen=True, slots=True)
class PromptRenderer:
    """Turns parts into what `/v1/completions` takes as `prompt`."""

    mode: PromptMode
    vocab_size: int
    tokenizer: Tokenizer | None = None

    def render(self, parts: tuple[Part, ...]) -> list[int] | str:
        if self.mode is PromptMode.TOKENS:
            ids: list[int] = []
            for part in parts:
                ids.extend(self._ids(part))
            return ids
        return "".join(
            segment_text(p.key, p.num_tokens) if isinstance(p, Segment) else p.text for p in parts
        )

    def _ids(self, part: Part) -> list[int]:
        if isinstance(part, Segment):
            return segment_ids(part.key, part.num_tokens, self.vocab_size)
        if part.token_ids is not None:
            return list(part.token_ids)
        if self.tokenizer is not None:
            return self.tokenizer.encode(part.text)
        raise MissingTokenIds(
            "token-mode history needs the previous output as token ids: the server returned "
            "none (return_token_ids); pass --tokenizer or use --prompt-mode text"
        )


@dataclass(frozen=True, slots=True)
class _HFTokenizer:
    inner: object

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.inner.encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]
        return ids


def load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer.json (or a directory holding one), for re-encoding outputs in token mode."""
    from pathlib import Path

    from tokenizers import Tokenizer as HFTokenizer

    p = Path(path)
    return _HFTokenizer(HFTokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p)))
