"""Stop strings, matched on detokenized text as it streams, across token boundaries.

A stream must never emit the start of a stop string that then completes, so the checker holds
back the longest tail of the text that is a proper prefix of some stop string:

    stop = ("</answer>",)
    push("42 </an")  -> emits "42 "   holds "</an"
    push("swer> ok") -> emits ""      stopped, matched "</answer>" (the stop string excluded)

"First" stop string means the first to complete, the one a stream can see: with stops
("abcd", "bc") and text "abcd", "bc" completes first and the output is "a", however the text
is split. (When no stop string contains another, that is also the earliest to start.) Of
several completing at the same character, the longest, which starts earliest, wins.

Each push costs O((len(text) + longest stop string) * number of stop strings): only the held
tail and the new text are searched, never the whole output.
"""

from __future__ import annotations

from typing import NamedTuple


class StopResult(NamedTuple):
    text: str  # what may be emitted now
    stopped: bool
    matched: str | None  # the stop string that completed, when stopped


class StopChecker:
    """One request's stop strings; push text as it is detokenized, flush at the end."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = stop
        self._first_chars = frozenset(s[0] for s in stop)
        self._max_hold = max((len(s) for s in stop), default=1) - 1
        self._held = ""
        self._stopped = False

    @property
    def is_stopped(self) -> bool:
        return self._stopped

    def push(self, text: str) -> StopResult:
        """New detokenized text in; the text that may be emitted now out."""
        if self._stopped:
            raise RuntimeError("push after a stop string matched")
        if not self._stop:
            return StopResult(text, False, None)
        buf = self._held + text
        # _held holds no complete stop string and is the longest tail that could start one,
        # so every match in buf ends in the new text and none starts before buf.
        match = self._first_match(buf)
        if match is not None:
            start, stop = match
            self._held, self._stopped = "", True
            return StopResult(buf[:start], True, stop)
        cut = self._hold_from(buf)
        self._held = buf[cut:]
        return StopResult(buf[:cut], False, None)

    def flush(self) -> str:
        """The held-back text, at the end of the request (empty after a stop)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first, the longest on a tie."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stop:
            # Only a match ending before the current best can win, so search no further.
            limit = len(buf) if best is None else best[0]
            start = buf.find(stop, 0, limit)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _hold_from(self, buf: str) -> int:
        """Index of the longest tail of buf that is a proper prefix of a stop string."""
        for i in range(max(0, len(buf) - self._max_hold), len(buf)):
            # Cheap filter first: most positions cannot start any stop string.
            if buf[i] in self._first_chars:
                tail = buf[i:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self._stop):
                    return i
        return len(buf)
