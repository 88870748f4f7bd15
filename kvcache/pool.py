"""The device page pool: KV tensor storage plus ref-counted page bookkeeping.

A page holds `page_size` consecutive tokens of one sequence, for every layer, K and V:

    kv[layer, 0 (K) | 1 (V), page_id, offset_in_page, kv_head, head_dim]

A token at position p of a sequence whose page table is `pages` lives in page
`pages[p // page_size]` at offset `p % page_size`; its flat "slot" is
`page_id * page_size + offset` (what the attention kernel writes to).

Pages are ref-counted so a later radix tree can share a prefix's pages between requests:
`allocate` hands out pages with one reference, `share` adds one, `free` drops one and a page
returns to the free list when its count reaches zero. Running out is a return value (None);
freeing a page that is not held is a broken invariant (an exception).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one model's KV cache; everything a pool needs to size and address pages."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int

    def page_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one page across all layers, K and V."""
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * elem

    def num_pages_for_budget(self, budget_bytes: int, dtype: torch.dtype) -> int:
        """How many whole pages fit in `budget_bytes`."""
        return budget_bytes // self.page_bytes(dtype)


class PagePool:
    """Ref-counted page ids `0 .. num_pages-1`; no tensors, so it is cheap to test exhaustively."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        # FIFO reuse: a freed page goes to the back, so recently freed pages (whose contents a
        # future prefix cache may still want) are handed out last.
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh pages with one reference each, or None (and no change) if they don't fit."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for page_id in pages:
            self._refcount[page_id] = 1
        return pages

    def share(self, page_ids: Iterable[int]) -> None:
        """Add a reference to pages that are already held."""
        for page_id in page_ids:
            if self._refcount[page_id] <= 0:
                raise RuntimeError(f"share of page {page_id}, which is not held")
            self._refcount[page_id] += 1

    def free(self, page_ids: Sequence[int]) -> None:
        """Drop one reference from each page; pages reaching zero return to the free list."""
        for page_id in page_ids:
            count = self._refcount[page_id]
            if count <= 0:
                raise RuntimeError(f"double free of page {page_id}")
            self._refcount[page_id] = count - 1
            if count == 1:
                self._free.append(page_id)

    def refcount(self, page_id: int) -> int:
        return self._refcount[page_id]

    def check_integrity(self) -> None:
        """Raise if the free list and reference counts disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page appears twice in the free list")
        for page_id, count in enumerate(self._refcount):
            if count < 0:
                raise AssertionError(f"page {page_id} has negative refcount {count}")
            if (count == 0) != (page_id in free):
                raise AssertionError(f"page {page_id}: refcount {count} but free={page_id in free}")


class DevicePool:
    """The KV tensor of one engine plus the PagePool that hands out its pages."""

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layout = layout
        self.pages = PagePool(num_pages)
        # One page past the pool's own is never handed out: a CUDA-graph decode step pads its
        # batch with rows that write their K/V there (engine.cuda_graphs).
        self.scratch_page = num_pages
        # [layers, 2, num_pages + 1, page_size, kv_heads, head_dim]
        self.kv = torch.zeros(
            (layout.num_layers, 2, num_pages + 1, layout.page_size, layout.num_kv_heads, layout.head_dim),
            dtype=dtype,
            device=device,
        )

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) views of one layer, each [num_pages, page_size, kv_heads, head_dim]."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def read_page(self, page_id: int) -> torch.Tensor:
        """One page across layers: [layers, 2, page_size, kv_heads, head_dim] (a view)."""
        return self.kv[:, :, page_id]

    def write_page(self, page_id: int, page: torch.Tensor) -> None:
        self.kv[:, :, page_id].copy_(page.to(self.kv.device, non_blocking=True))

    def check_integrity(self) -> None:
        self.pages.check_integrity()
