"""Streaming detokenization that never emits a split UTF-8 character.

Uses the prefix-offset / read-offset approach of vLLM and TGI: decode a short window of
previous tokens plus the new ones and emit only the text past what was already emitted, while
holding back a tail that still ends in an unfinished character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT_CHAR = "\ufffd"

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
