"""The workload's shape, measured online per route key: the token-weighted share of prompt
tokens that an earlier request of the same key had already sent -- the number that decides
whether prefix-aware serving pays, and the one `baton analyze-prefix` reports for a trace
(bench/analyze_prefix.py: ideal hit rate, whole pages, never a prompt's last token).

    meter.overlap(key)                    the key's rate over its last `window` requests
                                          (None below `min_samples`: unknown)
    meter.observe(key, hashes, tokens)    after routing: how much of this prompt the key had
                                          sent before (reusable tokens), then remember its pages

Memory is bounded twice: at most `max_keys` keys (the least recently seen is forgotten), and a
key remembers at most `pages_per_key` page hashes (least recently used first), so a key's
measure is an LRU cache's hit rate, like analyze-prefix's `lru_hit_rate` at that size.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Key:
    window: deque[tuple[int, int]]  # (reusable tokens, prompt tokens), newest last
    pages: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    reusable: int = 0  # sums over the window
    tokens: int = 0


def reusable_tokens(shared_pages: int, prompt_tokens: int, page_size: int) -> int:
    """Prompt tokens a cache can serve: whole pages, and never the prompt's last token."""
    return min(shared_pages * page_size, (prompt_tokens - 1) // page_size * page_size) if prompt_tokens else 0


class OverlapMeter:
    def __init__(self, window: int = 64, min_samples: int = 4, max_keys: int = 4096,
                 pages_per_key: int = 1 << 16) -> None:  # fmt: skip
        if window < 1 or min_samples < 1 or max_keys < 1 or pages_per_key < 1:
            raise ValueError("window, min_samples, max_keys and pages_per_key must be >= 1")
        self.window = window
        self.min_samples = min(min_samples, window)
        self.max_keys = max_keys
        self.pages_per_key = pages_per_key
        self._keys: OrderedDict[str, _Key] = OrderedDict()

    def overlap(self, key: str) -> float | None:
        k = self._keys.get(key)
        if k is None or len(k.window) < self.min_samples or not k.tokens:
            return None
        return k.reusable / k.tokens

    def observe(self, key: str, hashes: Sequence[bytes], prompt_tokens: int, page_size: int) -> int:
        """Record one request of `key` whose prompt's whole pages hash to `hashes` (chained);
        returns the tokens of it the key had already sent."""
        k = self._keys.get(key)
        if k is None:
            k = self._keys[key] = _Key(deque())
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(key)
        shared = 0
        for h in hashes:  # chained: the first page not seen ends the shared prefix
            if h not in k.pages:
                break
            shared += 1
        reusable = reusable_tokens(shared, prompt_tokens, page_size)
        for h in hashes:
            k.pages[h] = None
            k.pages.move_to_end(h)
        while len(k.pages) > self.pages_per_key:
            k.pages.popitem(last=False)
        k.window.append((reusable, prompt_tokens))
        k.reusable += reusable
        k.tokens += prompt_tokens
        if len(k.window) > self.window:
            old_reusable, old_tokens = k.window.popleft()
            k.reusable -= old_reusable
            k.tokens -= old_tokens
        return reusable

    def snapshot(self, limit: int = 64) -> dict[str, dict[str, float | int | None]]:
        """The most recently seen keys' measures, for /status."""
        out: dict[str, dict[str, float | int | None]] = {}
        for key in list(reversed(self._keys))[:limit]:
            k = self._keys[key]
            rate = self.overlap(key)
            out[key] = {"overlap": None if rate is None else round(rate, 4), "requests": len(k.window)}
        return out
