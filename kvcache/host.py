"""The host tier: a preallocated slab of pages in host RAM (pinned when the device is CUDA).

    slab[slot] : [layers, 2, page_size, kv_heads, head_dim]

Slots are handed out and returned like device pages; the tree decides what lives here.
"""

from __future__ import annotations

from collections import deque

import torch

from kvcache.pool import KVLayout


class HostTier:
    def __init__(self, layout: KVLayout, num_pages: int, dtype: torch.dtype, pin: bool = False) -> None:
        self.num_pages = num_pages
        shape = (num_pages, layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
        # Pinned memory lets device<->host copies run asynchronously on a side stream.
        self.slab = torch.empty(shape, dtype=dtype, pin_memory=pin and torch.cuda.is_available())
        self._free: deque[int] = deque(range(num_pages))
        self.bytes_in = 0
        self.bytes_out = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def store(self, page: torch.Tensor) -> int | None:
        """Copy a page in; its slot, or None when the slab is full."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self.slab[slot].copy_(page, non_blocking=True)
        self.bytes_in += page.numel() * page.element_size()
        return slot

    def load(self, slot: int) -> torch.Tensor:
        page = self.slab[slot]
        self.bytes_out += page.numel() * page.element_size()
        return page

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def check_integrity(self, cached_slots: int) -> None:
        if len(set(self._free)) != len(self._free):
            raise AssertionError("a host slot is free twice")
        if len(self._free) + cached_slots != self.num_pages:
            raise AssertionError(f"host: {len(self._free)} free + {cached_slots} cached != {self.num_pages}")
