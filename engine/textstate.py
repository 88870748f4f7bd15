"""Per-request text state: incremental detokenization and stop strings on text.

Stop strings are matched on text, not tokens, because a stop string can begin or end in the
middle of a token. The stop checker holds back any tail that could still become a stop
string, so a stream never shows text that a later token turns into a stop.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from engine.stop import StopChecker


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class TextDelta(NamedTuple):
    text: str
    stopped: bool  # a stop string matched; the request must finish with reason "stop"


class TextState:
    def __init__(self, detokenizer: Detokenizer, stop: tuple[str, ...]) -> None:
        self._detok = detokenizer
        self._stop = StopChecker(stop) if stop else None

    def push(self, token_id: int, check_stop: bool) -> TextDelta:
        """Text released by one more output token.

        `check_stop` is False until min_tokens is reached: as in vLLM, text produced before
        that point is never matched against stop strings.
        """
        text = self._detok.push(token_id)
        if self._stop is None or not check_stop:
            return TextDelta(text, False)
        result = self._stop.push(text)
        return TextDelta(result.text, result.stopped)

    def finish(self) -> str:
        """Held-back text, when the request ends for a reason other than a stop string."""
        text = self._detok.flush()
        if self._stop is None:
            return text
        result = self._stop.push(text)
        return result.text if result.stopped else result.text + self._stop.flush()
