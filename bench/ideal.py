"""The ideal prefix-hit count that P4 compares a server's hit rate against.

For each request: the longest common token-id prefix with any earlier request, in whole
pages. Pages are identified by a chained hash, so "this page and everything before it was
seen" is one set lookup per page:

    ids     | p0 | p1 | p2 | p3 |..
    hash    h0 = H(0, p0), h1 = H(h0, p1), h2 = H(h1, p2) ...
    cached  = page_size x (number of leading h_i already in the set)

A request's prompt pages join the set when it is sent; its output pages (prompt + output, when
the server returned output ids) when it completes, since a server may cache decoded tokens too.
Only token mode has ids to compare; text-mode runs report no ideal.
"""

from __future__ import annotations

from collections.abc import Sequence


class IdealPrefixIndex:
    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self._seen: set[int] = set()

    def _hashes(self, ids: Sequence[int]) -> list[int]:
        # Python's hash of a tuple of ints is not randomised per process, and a 64-bit
        # collision over a benchmark's few million pages is negligible.
        hashes: list[int] = []
        parent = 0
        for start in range(0, len(ids) - self.page_size + 1, self.page_size):
            parent = hash((parent, tuple(ids[start : start + self.page_size])))
            hashes.append(parent)
        return hashes

    def match(self, ids: Sequence[int]) -> int:
        """Tokens of `ids` an ideal cache would hold: leading full pages seen before."""
        n = 0
        for h in self._hashes(ids):
            if h not in self._seen:
                break
            n += 1
        return n * self.page_size

    def add(self, ids: Sequence[int]) -> None:
        self._seen.update(self._hashes(ids))

    def match_and_add(self, ids: Sequence[int]) -> int:
        cached = self.match(ids)
        self.add(ids)
        return cached
