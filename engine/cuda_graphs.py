"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured once.

A decode-only step of `n` sequences runs the graph of the smallest bucket >= n. The runner
owns every buffer a graph reads or writes, so a replay only refreshes their contents:

    staging (pinned host, int64)  --one copy-->  inputs (device, int64), viewed as
        ids [B] | positions [B] | slots [B] | lens [B] | carried [B] | table [B, max_pages]
    graph[bucket]: model.forward(ids[:b], positions[:b], meta(table[:b], lens[:b])) -> logits[:b]

Rows n..b-1 of a bucket are padding: token 0 at position 0, length 1, every page the pool's
scratch page (never handed out) in the columns this step stages, so their K/V writes and reads
touch nothing real (a row reads only its own pages: columns past them keep stale ids) and their
logits are dropped. The table is `max_pages` wide (the model's whole context) so every graph
is shape-static; the Triton kernel walks only each row's own length, which is why graphs are
used with the `triton` backend and the torch reference stays eager.

On CPU (`capture=False`) the same buffers and padding run eagerly: the tests check the
bucketing and padding against the plain runner there, and bench/gpu_check.py times
graph replay against eager steps on a device.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from engine.attention import AttnMetadata
from engine.model import CausalLM
from kvcache.pool import DevicePool


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Buckets 1, 2, 4, 8, then every 8 up to 64, then every 16: a step pads fewer than 8
    rows (16 past 64), and the number of graphs (captures, memory) stays small."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, min(max_batch, 64) + 1, 8))
    sizes += list(range(80, max_batch + 1, 16))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sorted(set(sizes)))


def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds `n` rows, or None when `n` is past the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        pool: DevicePool,
        max_batch: int,
        max_model_len: int,
        backend: str,
        capture: bool,
    ) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        ps = pool.layout.page_size
        self.page_size = ps
        self.max_pages = -(-max_model_len // ps)
        device = model.device
        b, w = self.max_batch, self.max_pages
        self._width = 5 * b + b * w
        pin = device.type == "cuda"
        # Two staging buffers, used in turn: with async scheduling the engine stages step k+1
        # while step k (and its copy out of the other buffer) may still be queued.
        self._stagings = [torch.zeros(self._width, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self._inputs = torch.zeros(self._width, dtype=torch.int64, device=device)
        self.ids, self.positions, self.slots, self.lens, self.carried = self._inputs[: 5 * b].view(5, b)
        self.table = self._inputs[5 * b :].view(b, w)
        self.logits = torch.zeros(b, model.cfg.vocab_size, dtype=torch.float32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self.num_carried_steps = 0  # steps whose input tokens came from the device (async)
        if capture:
            self._capture_all()

    def fits(self, n: int) -> bool:
        return 0 < n <= self.max_batch

    def run(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        tables: Sequence[Sequence[int]],
        carried: tuple[torch.Tensor, Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Logits [n, vocab] of one decode step of n = len(ids) sequences (a view: read it
        before the next call). `carried` = (tokens on the device, one index per row or -1):
        rows with an index take their input token from `tokens` (engine async scheduling)."""
        n = len(ids)
        bucket = bucket_for(n, self.sizes)
        if bucket is None:
            raise ValueError(f"batch of {n} is past the largest graph ({self.max_batch})")
        self._stage(ids, positions, slots, tables, bucket, carried[1] if carried is not None else None)
        if carried is not None:
            # On the device, after the staged copy and before the replay: no host wait.
            src = self.carried[:n]
            take = carried[0].index_select(0, src.clamp(min=0))
            self.ids[:n] = torch.where(src >= 0, take, self.ids[:n])
            self.num_carried_steps += 1
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
            self.num_replays += 1
        else:
            self._forward(bucket)
        return self.logits[:n]

    def _stage(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        tables: Sequence[Sequence[int]],
        bucket: int,
        carried: Sequence[int] | None = None,
    ) -> None:
        n, b, w = len(ids), self.max_batch, self.max_pages
        scratch = self.pool.scratch_page
        host = self._stagings[self._turn]
        self._turn ^= 1
        # Filled through numpy views of the staging buffer: a torch op per row (as_tensor and a
        # slice assignment) cost ~0.56 ms a step at batch 64 on CPU, numpy's ~0.06 ms.
        view = host.numpy()
        cols = view[: 5 * b].reshape(5, b)
        cols[0, :n] = ids
        cols[1, :n] = positions
        cols[2, :n] = slots
        np.add(cols[1, :n], 1, out=cols[3, :n])
        cols[4, :n] = carried if carried is not None else -1
        cols[0:2, n:bucket] = 0
        cols[2, n:bucket] = scratch * self.page_size
        cols[3, n:bucket] = 1
        cols[4, n:bucket] = -1
        # Only the columns some row uses this step: a row's attention reads its own pages and
        # no further, so what is left past them from earlier steps is never read. (The whole
        # width is max_model_len / page_size columns: 2 MB a step at batch 128 and 32k tokens.)
        used = max((len(pages) for pages in tables), default=1)
        if used > w:
            raise ValueError(f"a sequence of {used} pages is past the graphs' {w}")
        table = view[5 * b : 5 * b + bucket * used].reshape(bucket, used)
        table[:] = scratch
        for row, pages in enumerate(tables):
            table[row, : len(pages)] = pages
        # Two copies per step (the columns, the table's used block). The copies out of this
        # buffer two steps ago have finished: the engine has read that step's tokens since.
        self._inputs[: 5 * b].copy_(host[: 5 * b], non_blocking=True)
        block = host[5 * b : 5 * b + bucket * used].view(bucket, used)
        self.table[:bucket, :used].copy_(block, non_blocking=True)

    def _forward(self, bucket: int) -> None:
        meta = AttnMetadata(
            slot_mapping=self.slots[:bucket],
            prefills=(),
            num_prefill_tokens=0,
            decode_page_table=self.table[:bucket],
            decode_seq_lens=self.lens[:bucket],
            scale=self.model.scale,
            decode_backend=self.backend,
        )
        hidden = self.model.forward(self.ids[:bucket], self.positions[:bucket], meta, self.pool)
        self.logits[:bucket].copy_(self.model.compute_logits(hidden))

    def _capture_all(self) -> None:
        # Largest first, into one memory pool: smaller graphs reuse the larger ones' blocks.
        # Padding rows only (every row writes the scratch page) while capturing.
        mempool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.sizes, reverse=True):
            self._stage([], [], [], [], bucket)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # compiles the Triton kernel and warms cuBLAS outside capture
                    self._forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self._forward(bucket)
            self._graphs[bucket] = graph
        torch.cuda.synchronize()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)
