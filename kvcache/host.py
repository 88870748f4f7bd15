"""The host tier: a preallocated slab of pages in host RAM (pinned when the device is CUDA).

    slab[slot] : [layers, 2, page_size, kv_heads, head_dim]

Slots are handed out and returned like device pages; the tree decides what lives here.

On CUDA every copy runs asynchronously on one side stream, in order, so it overlaps the
host's scheduling work and the forward pass already queued:

    store(device page)      side stream waits for the compute stream, then copies D2H
    store_many(kv, pages)   the same for many pages: one indexed copy into a staging block,
                            then a copy per run of consecutive slots (eviction's batch)
    load_into(slot, dst)    H2D into the device page on the side stream
    load_many(slots, kv, pages)   the same for many pages: a copy per run of consecutive slots
                            into a staging block, then one indexed copy into the pool
    fence()                 the compute stream waits (on the GPU, not the host) for every copy
                            queued so far: the engine calls it before each forward, so no kernel
                            reads a promoted page early or overwrites an evicted one too soon
    load(slot)              a host read (the disk tier's write-back): waits for pending copies

A slot freed after load_into can be reused by a later store: both are on the one side
stream, so the later copy cannot overtake the earlier one. On CPU the copies are plain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

import torch

from kvcache.pool import KVLayout
from kvcache.upload import upload


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

    def store_many(self, kv: torch.Tensor, page_ids: Sequence[int]) -> list[int]:
        """Copy pages `page_ids` of a pool's `kv` ([layers, 2, pages, ...]) in, as many as there
        are free slots (the first ones); their slots, in order. On CUDA: one indexed copy into
        a staging block on the side stream, then one copy per run of consecutive slots; page
        by page (store), a strided device page cost a temporary and a kernel each (2.6 GB/s on
        the H200 against 55 GB/s in bulk, 2026-11-29; the staged path is not measured there yet)."""
        take = min(len(page_ids), len(self._free))
        if self._stream is None or not kv.is_cuda:  # on CPU page by page, as load_many
            return [slot for slot in (self.store(kv[:, :, p]) for p in page_ids[:take]) if slot is not None]
        if not take:
            return []
        slots = [self._free.popleft() for _ in range(take)]
        self._stream.wait_stream(torch.cuda.current_stream(kv.device))  # the pages are written
        with torch.cuda.stream(self._stream):
            index = upload(page_ids[:take], torch.int64, kv.device)
            staging = kv.index_select(2, index).movedim(2, 0).contiguous()  # [n, layers, 2, ...]
            for start, end in _runs(slots):
                first = slots[start]
                self.slab[first : first + end - start].copy_(staging[start:end], non_blocking=True)
        self._queued = True
        self.bytes_in += staging.numel() * staging.element_size()
        return slots

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

    def load_many(self, slots: Sequence[int], kv: torch.Tensor, page_ids: Sequence[int]) -> None:
        """Copy the slots' pages into pages `page_ids` of a pool's `kv` ([layers, 2, pages, ...]),
        ordered before the next fence. On CUDA: one copy per run of consecutive slots into a
        staging block on the device, then one indexed copy into the pool; page by page
        (load_into), a strided device page cost a temporary and a kernel each: 2.6 GB/s on the
        H200 against 55 GB/s in bulk (2026-11-29; the staged path is not measured there yet)."""
        if len(slots) != len(page_ids):
            raise ValueError(f"{len(slots)} slots for {len(page_ids)} pages")
        if not slots:
            return
        if self._stream is None or not kv.is_cuda:
            # On CPU the per-page copies are the faster: 5.3 ms for 128 baton-small pages
            # against 19 ms staged (a 50 MB staging block and an indexed copy along dim 2).
            for slot, page_id in zip(slots, page_ids, strict=True):
                self.load_into(slot, kv[:, :, page_id])
            return
        with torch.cuda.stream(self._stream):
            staging = torch.empty((len(slots), *self.slab.shape[1:]), dtype=self.slab.dtype, device=kv.device)
            for start, end in _runs(slots):
                first = slots[start]
                staging[start:end].copy_(self.slab[first : first + end - start], non_blocking=True)
            index = upload(page_ids, torch.int64, kv.device)
            kv.index_copy_(2, index, staging.movedim(0, 2))
        self._queued = True
        self.bytes_out += staging.numel() * staging.element_size()

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


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int]]:
    """[start, end) index ranges of `slots` whose values run consecutively: one copy each."""
    start = 0
    for end in range(1, len(slots) + 1):
        if end == len(slots) or slots[end] != slots[end - 1] + 1:
            yield start, end
            start = end
