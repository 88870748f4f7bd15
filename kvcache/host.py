"""The host tier: a preallocated slab of pages in host RAM (pinned when the device is CUDA).

    slab[slot] : [layers, 2, page_size, kv_heads, head_dim]

Slots are handed out and returned like device pages; the tree decides what lives here.

On CUDA every copy runs asynchronously on one side stream, in order, so it overlaps the
host's scheduling work and the forward pass already queued:

    store(device page)      side stream waits for the compute stream, then copies D2H
    load_into(slot, dst)    H2D into the device page on the side stream
    fence()                 the compute stream waits (on the GPU, not the host) for every copy
                            queued so far: the engine calls it before each forward, so no kernel
                            reads a promoted page early or overwrites an evicted one too soon
    load(slot)              a host read (the disk tier's write-back): waits for pending copies

A slot freed after load_into can be reused by a later store: both are on the one side
stream, so the later copy cannot overtake the earlier one. On CPU the copies are plain.
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
        cuda = pin and torch.cuda.is_available()
        self.slab = torch.empty(shape, dtype=dtype, pin_memory=cuda)
        self._stream = torch.cuda.Stream() if cuda else None
        self._queued = False  # copies on the side stream the compute stream has not fenced
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
        if self._stream is not None and page.is_cuda:
            self._stream.wait_stream(torch.cuda.current_stream(page.device))
            with torch.cuda.stream(self._stream):
                self.slab[slot].copy_(page, non_blocking=True)
            self._queued = True
        else:
            self.slab[slot].copy_(page)
        self.bytes_in += page.numel() * page.element_size()
        return slot

    def load(self, slot: int) -> torch.Tensor:
        """The slot's page, readable on the host now."""
        if self._stream is not None:
            self._stream.synchronize()
        page = self.slab[slot]
        self.bytes_out += page.numel() * page.element_size()
        return page

    def load_into(self, slot: int, dst: torch.Tensor) -> None:
        """Copy the slot's page into `dst` (a device page view), ordered before the next fence."""
        page = self.slab[slot]
        if self._stream is not None and dst.is_cuda:
            with torch.cuda.stream(self._stream):
                dst.copy_(page, non_blocking=True)
            self._queued = True
        else:
            dst.copy_(page)
        self.bytes_out += page.numel() * page.element_size()

    def fence(self) -> None:
        """Make the compute stream wait for every copy queued so far (no host wait)."""
        if self._stream is not None and self._queued:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._queued = False

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def check_integrity(self, cached_slots: int) -> None:
        if len(set(self._free)) != len(self._free):
            raise AssertionError("a host slot is free twice")
        if len(self._free) + cached_slots != self.num_pages:
            raise AssertionError(f"host: {len(self._free)} free + {cached_slots} cached != {self.num_pages}")
