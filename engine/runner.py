"""Model runner: turns a SchedulerOutput into tensors, runs the forward pass, samples.

Flat batch layout (prefill first, then decode — the layout engine.attention expects):

    input_ids  [T]   tokens each request computes this step
    positions  [T]   their positions in their sequences
    slots      [T]   page_id * page_size + position % page_size
    sample_idx [S]   index in T of the last token of each request that catches up this step

A request "catches up" when its computed tokens reach num_tokens; only those are sampled
(a partial chunk of a long prompt has nothing to sample yet).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.attention import AttnMetadata, DecodeRun, PrefillSeq, decode_groups, decode_runs
from engine.cpu_kernels import DecodePlan
from engine.cuda_graphs import DecodeGraphs
from engine.model import CausalLM
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, SamplingRow
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.structured import MaskJob
from kvcache.pool import DevicePool
from kvcache.upload import upload


class ForwardResult(NamedTuple):
    logits: torch.Tensor  # [S, vocab] float32, row i for sampled[i]
    sampled: list[tuple[Request, int]]  # (request, row in logits) for each request that caught up
    forward_s: float
    num_prefill_tokens: int
    num_decode_tokens: int


# An output token sampled on the device and not read back yet (engine async scheduling): it
# stands in request.output_ids until the engine resolves it, and the runner feeds the real
# token to the next step from the device (Carry).
PENDING = -1


class Carry(NamedTuple):
    """The step in flight's sampled tokens, still on the device: the next step's input for
    each request in `rows` (its token's row in `tokens`)."""

    tokens: torch.Tensor  # [S] int64, on the model's device
    rows: dict[Request, int]


class RunResult(NamedTuple):
    sampled: list[tuple[Request, int]]  # (request, index into sampler output)
    samples: SamplerOutput
    forward_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    mask_wait_s: float = 0.0  # waiting for grammar masks after the forward (what overlap did not hide)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        pool: DevicePool,
        sampler: Sampler,
        eos_ids: tuple[int, ...],
        decode_backend: str = "torch",
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.sampler = sampler
        self.eos_ids = eos_ids
        self.page_size = pool.layout.page_size
        self.device = model.device
        self.decode_backend = decode_backend
        self.graphs = graphs  # decode-only steps that fit replay a captured graph

    def execute(self, out: SchedulerOutput, masks: MaskJob | None = None) -> RunResult:
        """Forward the scheduled tokens and sample for every request that caught up, under
        the grammar masks being filled meanwhile (engine.structured) for constrained ones."""
        fwd = self.forward(out)
        return self.sample(fwd, [self.sampling_row(request) for request, _ in fwd.sampled], masks)

    def sample(self, fwd: ForwardResult, rows: Sequence[SamplingRow], masks: MaskJob | None = None) -> RunResult:
        """Sample the rows of a forward pass (their SamplingRows in order) on the host."""
        start = time.perf_counter()
        mask = masks.wait(fwd.sampled) if masks is not None else None
        mask_wait_s = time.perf_counter() - start
        samples = self.sampler(fwd.logits, rows, mask) if rows else SamplerOutput([], [])
        return RunResult(
            fwd.sampled, samples, fwd.forward_s, fwd.num_prefill_tokens, fwd.num_decode_tokens, mask_wait_s
        )

    def forward(self, out: SchedulerOutput, carry: Carry | None = None) -> ForwardResult:
        """The forward pass alone: logits [S, vocab] of the requests that caught up. A request
        whose next input token is PENDING takes it from `carry`, on the device."""
        prefills = [s for s in out.scheduled if s.num_new > 1]
        decodes = [s for s in out.scheduled if s.num_new == 1]
        keys: list[int] = []  # the torch path's prefix keys, one per decode row (order_decodes)
        if self.decode_backend in ("torch", "cpu"):
            decodes, keys = order_decodes(decodes)
        ordered = prefills + decodes
        sample_idx: list[int] = []
        sampled: list[tuple[Request, int]] = []
        offset = 0
        for request, num_new in ordered:
            offset += num_new
            if request.num_computed_tokens + num_new == request.num_tokens:
                sampled.append((request, len(sample_idx)))
                sample_idx.append(offset - 1)

        start = time.perf_counter()
        if self.graphs is not None and not prefills and self.graphs.fits(len(decodes)):
            logits = self._graph_step(decodes, carry)
            if len(sample_idx) < len(decodes):  # a 1-token prompt chunk that samples nothing yet
                logits = logits[self._tensor(sample_idx)]
        else:
            input_ids, positions, slots = self._flat_inputs(ordered, carry)
            meta = self._metadata(prefills, decodes, slots, keys)
            hidden = self.model.forward(input_ids, positions, meta, self.pool)
            logits = self.model.compute_logits(hidden[self._tensor(sample_idx)])
        forward_s = time.perf_counter() - start
        num_prefill = sum(s.num_new for s in prefills)
        return ForwardResult(logits, sampled, forward_s, num_prefill, len(decodes))

    def _graph_step(self, decodes: Sequence[ScheduledRequest], carry: Carry | None) -> torch.Tensor:
        assert self.graphs is not None
        ps = self.page_size
        ids, positions, slots, tables, src = [], [], [], [], []
        for request, _ in decodes:
            pos = request.num_computed_tokens
            pages = request.page_ids
            token = request.token_slice(pos, pos + 1)[0]
            src.append(_carried(carry, request, token))
            ids.append(max(token, 0))
            positions.append(pos)
            slots.append(pages[pos // ps] * ps + pos % ps)
            tables.append(pages[: pos // ps + 1])
        if carry is None or max(src) < 0:
            return self.graphs.run(ids, positions, slots, tables)
        return self.graphs.run(ids, positions, slots, tables, carried=(carry.tokens, src))

    def _flat_inputs(
        self, ordered: Sequence[ScheduledRequest], carry: Carry | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        dst: list[int] = []  # flat positions of PENDING inputs, and their rows in carry.tokens
        src: list[int] = []
        ps = self.page_size
        for request, num_new in ordered:
            start = request.num_computed_tokens
            tokens = request.token_slice(start, start + num_new)
            if tokens[-1] == PENDING:  # only ever a request's last token
                row = _carried(carry, request, PENDING)
                dst.append(len(ids) + num_new - 1)
                src.append(row)
                tokens[-1] = 0
            ids.extend(tokens)
            pages = request.page_ids
            for p in range(start, start + num_new):
                pos.append(p)
                slots.append(pages[p // ps] * ps + p % ps)
        to = self._tensor
        input_ids = to(ids)
        if dst:
            assert carry is not None
            input_ids.index_copy_(0, to(dst), carry.tokens.index_select(0, to(src)))
        return input_ids, to(pos), to(slots)

    def _metadata(
        self,
        prefills: Sequence[ScheduledRequest],
        decodes: Sequence[ScheduledRequest],
        slots: torch.Tensor,
        keys: Sequence[int],
    ) -> AttnMetadata:
        seqs: list[PrefillSeq] = []
        start = 0
        for request, num_new in prefills:
            context = request.num_computed_tokens + num_new
            num_pages = -(-context // self.page_size)
            page_ids = self._tensor(request.page_ids[:num_pages])
            seqs.append(PrefillSeq(start, num_new, context, page_ids))
            start += num_new
        max_pages = max((len(r.page_ids) for r, _ in decodes), default=0)
        if self.decode_backend == "cpu":  # the plan carries the pages; the table's rows count decodes
            max_pages = 0
        table = [r.page_ids[:max_pages] + [0] * (max_pages - len(r.page_ids)) for r, _ in decodes]
        page_table = self._tensor(table).view(len(decodes), max_pages)
        seq_lens = self._tensor([r.num_computed_tokens + 1 for r, _ in decodes])
        runs: tuple[DecodeRun, ...] = ()
        plan: DecodePlan | None = None
        if self.decode_backend == "cpu" and decodes:  # once per step, not once per layer
            rows = [(r.page_ids, r.num_computed_tokens + 1) for r, _ in decodes]
            cfg = self.model.cfg
            plan = DecodePlan.build(rows, keys, self.page_size, cfg.num_heads, cfg.head_dim, torch.get_num_threads())
        if self.decode_backend == "torch" and decodes:  # once per step, not once per layer
            widths = [-(-(r.num_computed_tokens + 1) // self.page_size) for r, _ in decodes]
            groups = decode_groups(widths, keys)
            cascade = [keys[first] >= 0 and end - first > 1 for first, end, _ in groups]
            runs = decode_runs(page_table, seq_lens, self.page_size, self.model.dtype, groups, cascade)
        return AttnMetadata(
            slot_mapping=slots,
            prefills=tuple(seqs),
            num_prefill_tokens=start,
            decode_page_table=page_table,
            decode_seq_lens=seq_lens,
            scale=self.model.scale,
            decode_backend=self.decode_backend,
            decode_runs=runs,
            cpu_plan=plan,
        )

    def sampling_row(self, request: Request) -> SamplingRow:
        params = request.sampling
        blocked: tuple[int, ...] = ()
        if len(request.output_ids) < params.min_tokens:
            blocked = self.eos_ids + params.stop_token_ids
        return SamplingRow(
            params=params,
            position=request.num_tokens,
            output_ids=request.output_ids,
            prompt_ids=request.prompt_ids,
            blocked_ids=blocked,
        )

    def _tensor(self, data: list[int] | list[list[int]]) -> torch.Tensor:
        return upload(data, torch.int64, self.device)  # not waiting for the step in flight


def _carried(carry: Carry | None, request: Request, token: int) -> int:
    """The row of `carry.tokens` holding a PENDING input token, or -1 for a known token."""
    if token != PENDING:
        return -1
    if carry is None or request not in carry.rows:
        raise RuntimeError(f"{request.req_id}: a pending token without the step that samples it")
    return carry.rows[request]


def prefix_keys(decodes: Sequence[ScheduledRequest]) -> list[int]:
    """Per decode row, its first page id when another row starts with the same page (the two
    may share a cached prefix: engine.attention's cascade), else -1."""
    firsts = [request.page_ids[0] for request, _ in decodes]
    counts = Counter(firsts)
    return [page if counts[page] > 1 else -1 for page in firsts]


def order_decodes(decodes: Sequence[ScheduledRequest]) -> tuple[list[ScheduledRequest], list[int]]:
    """The torch path's row order, with each row's prefix key (prefix_keys) in that order:
    rows that start with a page another row starts with come first, together by that page;
    the rest after them; longest first within each (so rows of similar length and shared
    prefix form one run: engine.attention.decode_groups)."""
    keys = prefix_keys(decodes)
    order = sorted(range(len(decodes)), key=lambda i: (keys[i] < 0, keys[i], -decodes[i].request.num_computed_tokens))
    return [decodes[i] for i in order], [keys[i] for i in order]


class InFlight:
    """A step sampled on the device and not read back (async scheduling): its tokens, the
    PENDING slot each request holds for its token, and each request's row in `tokens`."""

    def __init__(self, tokens: torch.Tensor, pending: list[tuple[Request, int]], rows: dict[Request, int]) -> None:
        self.tokens = tokens
        self.pending = pending
        self.rows = rows
        self.resolved = False
        self._host = tokens.to("cpu", non_blocking=True)  # pinned, when tokens are on a GPU
        self._event: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @property
    def carry(self) -> Carry:
        return Carry(self.tokens, self.rows)

    def read(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
