"""The engine: one model on one device, stepping a continuous batch.

    add_request(...)  -> validated, queued
    step()            -> schedule -> run -> update  -> list[StepOutput]
    abort(req_id)     -> frees every page the request holds, in any state

Prefill and decode are not phases here (see engine.request): the same step serves a
prefill-only worker, a decode worker and a colocated one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from engine.allocator import tune_allocator
from engine.builtin import resolve_model_dir
from engine.config import ModelConfig
from engine.cpu_decode import cpu_decode_step_for
from engine.cuda_graphs import DecodeGraphs
from engine.engine_config import EngineConfig
from engine.errors import RequestError
from engine.faults import FaultPoints
from engine.job import Job
from engine.kernel_info import EngineKernels, kernels_of
from engine.loader import checkpoint_fingerprint, load_state_dict
from engine.model import CausalLM, fused_ops_for
from engine.outputs import ExportedKV, StepOutput, StepStats, TokenLogprobs
from engine.pins import PIN_REQUEST_PREFIX, Pin, Pins, PinView
from engine.request import NOT_CACHED, CachedTokens, FinishReason, Request, RequestStatus
from engine.runner import PENDING, ForwardResult, InFlight, ModelRunner, RunResult
from engine.sampler import Sampler, SamplerOutput, deferrable
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from engine.step_cost import key_weight
from engine.structured import GrammarMatcher, MaskJob, StructuredOutputs
from engine.textstate import TextState
from engine.tokenizer import Tokenizer
from kvcache.hashing import model_fingerprint
from kvcache.pool import DevicePool, KVLayout
from kvcache.radix import PrefixCache
from kvcache.tiers import build_tiers

logger = logging.getLogger(__name__)

PIN_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # a pin's internal request


def _no_fence() -> None:
    pass


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        tune_allocator()  # before the first activation: a step's buffers stay in the heap
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device)
        model_dir = resolve_model_dir(cfg.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.dtype = cfg.resolve_dtype(self.model_config.torch_dtype)
        weights = load_state_dict(model_dir, self.model_config, self.dtype, self.device)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.model = CausalLM(self.model_config, weights, self.device)
        self.max_model_len = min(
            cfg.max_model_len or self.model_config.max_model_len, self.model_config.max_model_len
        )
        mc = self.model_config
        layout = KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim, cfg.page_size)
        self.kv_dtype = cfg.resolve_kv_dtype(self.dtype)
        num_pages = cfg.num_pages or layout.num_pages_for_budget(cfg.kv_bytes(self.device), self.kv_dtype)
        self.pool = DevicePool(layout, num_pages, self.kv_dtype, self.device)
        # The KV's precision is part of a page's identity: pages stored in another precision
        # are other pages (the default keeps the fingerprints pages had before the option).
        kv_tag = "" if self.kv_dtype == self.dtype else f"/kv:{self.kv_dtype}"
        self.fingerprint = model_fingerprint(checkpoint_fingerprint(model_dir), str(self.dtype) + kv_tag)
        self.prefix_cache: PrefixCache | None = None
        # before each forward: the host tier's queued copies are in (CUDA); nothing without one
        self._fence: Callable[[], None] = _no_fence
        if cfg.enable_prefix_cache:
            host, disk = build_tiers(cfg.tiers, layout, self.kv_dtype, self.fingerprint, self.device.type == "cuda")
            self.prefix_cache = PrefixCache(
                self.pool.pages, cfg.page_size, device=self.pool, host=host, disk=disk, ttl_s=cfg.tiers.page_ttl_s,
                write_back_pages=cfg.tiers.write_back_pages,
            )
            if host is not None:
                self._fence = host.fence
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_prefill_chunk, cfg.page_size,
                            cfg.itl_target_ms / 1e3 if cfg.itl_target_ms else None,
                            policy=cfg.scheduler_policy),
            self.pool.pages,
            self.prefix_cache,
            self.fingerprint,
        )
        self.scheduler.worth.key_weight = key_weight(mc.num_layers, mc.hidden_size, mc.intermediate_size,
                                                     mc.num_heads, mc.num_kv_heads, mc.head_dim)
        # Tokenizer files and config.json may each name EOS ids (Llama 3 lists several): stop on any.
        self.eos_ids = tuple(dict.fromkeys(self.tokenizer.eos_token_ids + mc.eos_token_ids))
        backend = cfg.resolve_attention_backend(self.model.dtype, self.kv_dtype)
        self.model.fused_ops = fused_ops_for(backend, self.device, self.model.dtype, self.kv_dtype)
        self.model.decode_step = cpu_decode_step_for(self.model, self.kv_dtype)
        graphs = None
        if self.device.type == "cuda" and backend == "triton" and cfg.cuda_graph_max_batch > 0:
            graphs = DecodeGraphs(
                self.model, self.pool, min(cfg.cuda_graph_max_batch, cfg.max_num_seqs), self.max_model_len,
                backend, capture=True,
            )  # fmt: skip
        sampler = Sampler(mc.vocab_size, seed=cfg.seed)
        self.structured = StructuredOutputs(
            self.tokenizer.to_json, mc.vocab_size, self.eos_ids, cfg.structured, self.device
        )
        self.runner = ModelRunner(self.model, self.pool, sampler, self.eos_ids, backend, graphs)
        use_async = cfg.async_scheduling
        self.async_scheduling = graphs is not None if use_async is None else use_async
        self._inflight: InFlight | None = None  # async scheduling: the step not read back yet
        self._arrivals = 0
        self._exported: dict[str, ExportedKV] = {}
        # Pinned prefixes (engine.pins): at most half the pool, so requests always have room.
        self.pins = Pins(self.prefix_cache, self.pool.pages, num_pages // 2)
        self._pin_requests: dict[str, tuple[Pin, list[bytes]]] = {}  # computing a pin's pages
        # Operator-shared prefixes; the server may add tokenized ones after start-up.
        self.shared_prefixes: tuple[tuple[int, ...], ...] = cfg.shared_prefixes
        self.last_stats: StepStats | None = None
        self.num_preempted_total = 0  # requests preempted (recomputed later) since start
        self.faults = FaultPoints()  # drills only: armed failures (engine.faults)
        self.kernels: EngineKernels = kernels_of(self)  # fixed from here on: /status reads it per call
        logger.info(
            "engine ready: %s (%s, %s), %d pages x %d tokens, max_model_len %d",
            model_dir.name, self.dtype, self.device, num_pages, cfg.page_size, self.max_model_len,
        )

    # -- requests ---------------------------------------------------------------------------

    def add(self, job: Job, export_kv: bool = False) -> None:
        """Queue a request; RequestError if it can never run here (checked before any allocation).

        `job.cache_salt` (the tenant) keys the request's cached pages: only requests with the
        same salt share them. `export_kv` (the prefill role) keeps a copy of the prompt's KV when
        the request finishes, for `take_exported`. A constraint that does not compile is a
        ConstraintError here (see `prepare` to compile it off the step thread first).
        """
        request = self._request(job)
        request.export_kv = export_kv
        request.num_shared_pages = self._shared_pages(request.prompt_ids)
        self.scheduler.add(request)

    def add_request(self, req_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, priority: int = 0,
                    cache_salt: str = "", export_kv: bool = False) -> None:  # fmt: skip
        """`add` for a caller without a Job (offline use, benchmarks, tests): the same checks."""
        self.add(Job(req_id, tuple(prompt_ids), sampling, priority, cache_salt), export_kv)

    def _request(self, job: Job, first_token: int | None = None) -> Request:
        """A validated Request for `job`; with `first_token` (sampled elsewhere under the same
        constraint), its constraint's state is advanced past that token."""
        self._validate(job.req_id, job.prompt_ids, job.sampling)
        if not 0 <= job.num_resumed < len(job.prompt_ids):
            raise RequestError("num_resumed", f"must be in [0, {len(job.prompt_ids)}), got {job.num_resumed}")
        request = Request(job.req_id, list(job.prompt_ids), job.sampling, job.priority, self._arrivals, job.slo)
        request.matcher = self._new_matcher(job, first_token)
        self._arrivals += 1
        request.cache_salt = job.cache_salt.encode()
        request.in_session = bool(job.session)
        request.reuse_cache = job.reuse_cache
        if self.cfg.detokenize:
            request.text = TextState(self.tokenizer.new_detokenizer(request.prompt_ids), job.sampling.stop)
        return request

    def _shared_pages(self, prompt_ids: list[int]) -> int:
        """Whole pages of the longest operator-shared prefix this prompt starts with."""
        best = 0
        for prefix in self.shared_prefixes:
            n = len(prefix)
            if n > best and len(prompt_ids) >= n and tuple(prompt_ids[:n]) == prefix:
                best = n
        return best // self.cfg.page_size

    def prepare(self, sampling: SamplingParams) -> None:
        """Compile the request's constraint, if any, now; ConstraintError if it is refused.

        Thread-safe, and meant to run off the step thread (AsyncEngine.generate does): the
        compiled grammar is cached, so `add_request` then finds it without waiting."""
        if sampling.constraint is not None:
            self.structured.prepare(sampling.constraint)

    def is_prepared(self, sampling: SamplingParams) -> bool:
        """True when `add_request` will not compile anything (thread-safe)."""
        return sampling.constraint is None or self.structured.compiler.is_cached(sampling.constraint)

    def _new_matcher(self, job: Job, first_token: int | None) -> GrammarMatcher | None:
        """The constraint's matcher (None: unconstrained), advanced past the output the request
        already has: what it emitted before it moved (`job.num_resumed`, the prompt's tail) and
        a first token sampled elsewhere. Tokens the grammar refuses fail the request, not the
        engine. Resumed tokens that complete the grammar leave EOS the only token its mask
        allows: the request ends "stop" on its first sample."""
        if job.sampling.constraint is None:
            return None
        matcher = self.structured.new_matcher(job.sampling.constraint)
        emitted = job.prompt_ids[len(job.prompt_ids) - job.num_resumed :]
        if matcher.resume(emitted) == FinishReason.ABORT:
            raise RequestError("constraint", f"the output emitted before the request moved (num_resumed="
                                             f"{len(emitted)}) breaks its constraint here; it cannot continue")  # fmt: skip
        if first_token is not None and matcher.advance(first_token) is not None:
            raise RequestError("constraint", "the first token ends or breaks the constraint; it cannot continue here")
        return matcher

    def _validate(self, req_id: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        if self.scheduler.get(req_id) is not None:
            raise RequestError("req_id", f"request {req_id!r} is already running")
        if not prompt_ids:
            raise RequestError("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError("prompt", f"token ids must be in [0, {vocab})")
        if any(t >= vocab for t, _ in sampling.logit_bias):
            raise RequestError("logit_bias", f"token ids must be in [0, {vocab})")
        total = len(prompt_ids) + sampling.max_tokens
        if total > self.max_model_len:
            raise RequestError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                f"the model's context of {self.max_model_len} tokens",
            )
        if -(-total // self.cfg.page_size) > self.pool.num_pages:
            raise RequestError("max_tokens", "the request needs more KV pages than this worker has")

    def abort(self, req_id: str) -> bool:
        """Stop a request in any state and free its pages; False if it was not here."""
        request = self.scheduler.abort(req_id)
        if request is not None and request.output_ids and request.output_ids[-1] == PENDING:
            request.output_ids.pop()  # its token in flight is dropped when read back
        return request is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_requests > 0

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One step of the batch; with async scheduling, the outputs of the step before it
        (and of this one when it could not be deferred)."""
        prev, self._inflight = self._inflight, None
        try:
            outputs = self._step(prev)
        except BaseException:
            if prev is not None and not prev.resolved:
                self._inflight = prev  # still to be read: the next step starts from it
            raise
        if self._pin_requests:
            outputs = self._pin_outputs(outputs)
        if len(self.pins):
            self._expire_pins()
        return outputs

    def _step(self, prev: InFlight | None) -> list[StepOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        self.num_preempted_total += len(sched.preempted)
        if not sched.scheduled:
            return self._resolve(prev) if prev is not None else []
        self._fence()  # promoted pages are in, evicted ones out
        masks = self.structured.start(sched.scheduled)  # filled while the forward runs
        self.faults.hit("forward")  # drills only (engine.faults): a failed forward pass
        if self.async_scheduling or prev is not None:  # turned off with a step in flight: read it too
            fwd = self.runner.forward(sched, prev.carry if prev is not None else None)
            result, outputs = self._sample_async(sched, fwd, masks, prev)
        else:
            result = self.runner.execute(sched, masks)
            outputs = self._update(sched.scheduled, result)
        self.scheduler.observe(sched, result.forward_s)  # the ITL target's cost model, when set
        pages = self.pool.pages
        self.last_stats = StepStats(
            step_s=time.perf_counter() - start,
            forward_s=result.forward_s,
            num_prefill_tokens=result.num_prefill_tokens,
            num_decode_tokens=result.num_decode_tokens,
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            num_preempted=len(sched.preempted),
            num_finished=sum(o.finished for o in outputs),
            pages_used=pages.num_used,
            pages_total=pages.num_pages,
            num_constrained=len(masks.requests) if masks is not None else 0,
            mask_wait_s=result.mask_wait_s,
        )
        return outputs

    def _sample_async(
        self, sched: SchedulerOutput, fwd: ForwardResult, masks: MaskJob | None, prev: InFlight | None
    ) -> tuple[RunResult, list[StepOutput]]:
        """Sample step k on the device and leave it in flight when every row allows it (then
        read step k-1 back while the device works); else read k-1, then sample k as usual."""
        rows = [self.runner.sampling_row(request) for request, _ in fwd.sampled]
        defer = (
            self.async_scheduling
            and bool(rows)
            and masks is None
            and all(deferrable(row) for row in rows)
            and not any(request.export_kv for request, _ in fwd.sampled)
        )
        if not defer:
            outputs = self._resolve(prev) if prev is not None else []
            result = self.runner.sample(fwd, rows, masks)
            return result, outputs + self._update(sched.scheduled, result)
        tokens = self.runner.sampler.sample_tokens(fwd.logits, rows)
        inflight = InFlight(tokens, [], {})
        for request, num_new in sched.scheduled:
            request.num_computed_tokens += num_new
        for request, row in fwd.sampled:
            request.output_ids.append(PENDING)
            inflight.pending.append((request, len(request.output_ids) - 1))
            inflight.rows[request] = row
            if len(request.output_ids) >= request.sampling.max_tokens or request.num_tokens >= self.max_model_len:
                request.finishing = True
        outputs = self._resolve(prev) if prev is not None else []
        for request, _ in sched.scheduled:
            if request.status == RequestStatus.RUNNING:
                self.scheduler.commit(request)
        self._inflight = inflight
        empty = SamplerOutput([], [])
        return RunResult([], empty, fwd.forward_s, fwd.num_prefill_tokens, fwd.num_decode_tokens), outputs

    def _resolve(self, inflight: InFlight) -> list[StepOutput]:
        """Read a deferred step's tokens back and finish its outputs, in order. A request that
        finished or was aborted meanwhile is skipped; its token is dropped."""
        tokens = inflight.read()
        inflight.resolved = True
        outputs = []
        for request, index in inflight.pending:
            if request.status == RequestStatus.FINISHED:
                continue
            token = tokens[inflight.rows[request]]
            request.output_ids[index] = token
            text, reason = self._check_finish(request, token, num_out=index + 1)
            if reason is not None:
                del request.output_ids[index + 1 :]  # a token computed after the end
                if request.status == RequestStatus.RUNNING:
                    self.scheduler.finish(request)
                else:  # preempted meanwhile: it waits in the queue
                    self.scheduler.abort(request.req_id)
            outputs.append(self._output(request, token, None, text, reason, index + 1))
        return outputs

    def _update(self, scheduled: Sequence[tuple[Request, int]], result: RunResult) -> list[StepOutput]:
        for request, num_new in scheduled:
            if request.status != RequestStatus.RUNNING:
                continue  # async scheduling: it ended on the token read back before this step
            request.num_computed_tokens += num_new
            self.scheduler.commit(request)
        outputs = []
        for request, row in result.sampled:
            if request.status != RequestStatus.RUNNING:
                continue
            token = result.samples.token_ids[row]
            logprob = result.samples.logprobs[row]
            request.output_ids.append(token)
            grammar = request.matcher.advance(token) if request.matcher is not None else None
            text, reason = self._check_finish(request, token, grammar)
            if reason is not None:
                if request.export_kv:
                    self._export(request)
                self.scheduler.finish(request)
            outputs.append(self._output(request, token, logprob, text, reason, len(request.output_ids)))
        return outputs

    @staticmethod
    def _output(
        request: Request,
        token: int,
        logprob: TokenLogprobs | None,
        text: str,
        reason: FinishReason | None,
        num_out: int,
    ) -> StepOutput:
        return StepOutput(
            req_id=request.req_id,
            token_ids=(token,),
            text=text,
            logprobs=(logprob,) if logprob is not None else (),
            finish_reason=reason,
            num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=num_out,
            cached=request.cached,
        )

    def _check_finish(
        self, request: Request, token: int, grammar: FinishReason | None = None, num_out: int | None = None
    ) -> tuple[str, FinishReason | None]:
        """Why the request ends after `token`, its `num_out`-th output (default: the last), if
        it does; `grammar` is its constraint's say (complete: STOP, failed: ABORT), which ends
        it whatever min_tokens or ignore_eos say."""
        params = request.sampling
        num_out = len(request.output_ids) if num_out is None else num_out
        can_stop = num_out >= params.min_tokens
        text = ""
        if request.text is not None:
            delta = request.text.push(token, check_stop=can_stop)
            if delta.stopped:
                return delta.text, FinishReason.STOP
            text = delta.text
        reason: FinishReason | None = None
        if grammar is not None:
            reason = grammar
        elif can_stop and not params.ignore_eos and token in self.eos_ids:
            reason = FinishReason.STOP
        elif can_stop and token in params.stop_token_ids:
            reason = FinishReason.STOP
        elif num_out >= params.max_tokens or len(request.prompt_ids) + num_out >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None and request.text is not None:
            text += request.text.finish()
        return text, reason

    # -- conveniences -----------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[int]]:
        """Run prompts to completion (offline use and tests): output token ids per prompt."""
        ids = [f"gen-{self._arrivals + i}" for i in range(len(prompts))]
        for req_id, prompt in zip(ids, prompts, strict=True):
            self.add_request(req_id, prompt, sampling)
        tokens: dict[str, list[int]] = {req_id: [] for req_id in ids}
        while self.has_unfinished():
            for out in self.step():
                tokens[out.req_id].extend(out.token_ids)
        self.flush_cache()
        return [tokens[req_id] for req_id in ids]

    def prompt_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Logits [vocab] for the token after `prompt_ids`, from one whole-prompt prefill.

        For scoring and parity checks; runs outside the continuous batch, so only when idle.
        """
        if self.has_unfinished():
            raise RuntimeError("prompt_logits needs an idle engine")
        self._validate("score", prompt_ids, SamplingParams(max_tokens=1))
        request = Request("score", list(prompt_ids), SamplingParams(max_tokens=1), 0, -1)
        pages = self.pool.pages.allocate(-(-len(prompt_ids) // self.cfg.page_size))
        if pages is None:
            raise RequestError("prompt", "not enough free KV pages to score this prompt")
        request.page_ids = pages
        try:
            sched = SchedulerOutput((ScheduledRequest(request, len(prompt_ids)),), ())
            return self.runner.forward(sched).logits[0]
        finally:
            self.pool.pages.free(pages)

    def close(self) -> None:
        """Flush and release the disk tier (its directory is locked while an engine uses it);
        stop the grammar threads."""
        self.structured.close()
        if self.prefix_cache is not None and self.prefix_cache.disk is not None:
            self.prefix_cache.disk.close()

    # -- disaggregation: the prefill and decode roles ------------------------------------------

    def _export(self, request: Request) -> None:
        n_prompt = len(request.prompt_ids)
        n_pages = -(-n_prompt // self.cfg.page_size)
        index = torch.tensor(request.page_ids[:n_pages], dtype=torch.int64, device=self.device)
        # Page-major and contiguous, so each chunk of pages is one slice; it stays on the pool's
        # device (the nccl transport sends it from there; the codec stages host-bound chunks).
        kv = self.pool.kv.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()
        hashes = self.scheduler.prefix_hashes(request, n_prompt // self.cfg.page_size) if self.prefix_cache else []
        self._exported[request.req_id] = ExportedKV(request.req_id, n_prompt, request.output_ids[0], kv, tuple(hashes))

    def take_exported(self, req_id: str) -> ExportedKV | None:
        """The prompt KV and first token of a finished `export_kv` request (once)."""
        return self._exported.pop(req_id, None)

    def reserve_pages(self, num_tokens: int) -> list[int] | None:
        """Pages for `num_tokens` tokens of KV arriving from elsewhere (decode role), or None."""
        n = -(-num_tokens // self.cfg.page_size)
        return self.prefix_cache.allocate(n) if self.prefix_cache is not None else self.pool.pages.allocate(n)

    def release_pages(self, page_ids: Sequence[int]) -> None:
        """Give back a reservation that will not be used (a failed or expired transfer)."""
        self.pool.pages.free(page_ids)

    def keep_pages(self, job: Job, page_ids: Sequence[int]) -> int:
        """Offer to the prefix cache reserved pages that hold `job`'s leading prompt KV, moved
        here and verified before its transfer failed part-way (the caller still releases the
        reservation: the cache keeps its own reference). A re-run of the prompt here then
        computes only the rest. How many of them the cache did not have yet."""
        n = min(len(page_ids), len(job.prompt_ids) // self.cfg.page_size)
        if self.prefix_cache is None or n == 0:
            return 0
        request = Request(job.req_id, list(job.prompt_ids), job.sampling, job.priority, 0, job.slo)
        request.cache_salt, request.in_session = job.cache_salt.encode(), bool(job.session)
        request.num_shared_pages = self._shared_pages(request.prompt_ids)  # hashed as its own run would
        hashes = self.scheduler.prefix_hashes(request, n)
        return self.prefix_cache.insert(hashes, list(page_ids[:n]), 0, request.cache_salt, request.in_session)

    def add_prefilled(self, job: Job, first_token: int, page_ids: list[int], cached: CachedTokens = NOT_CACHED) -> None:
        """Join the running batch with a prompt whose KV already fills `page_ids` (reserved
        with `reserve_pages`; ownership passes to the request) and whose first token was
        sampled elsewhere (`cached`: the prefill side's reuse, for usage: from another worker's
        cache, since its pages were shipped here). The next step samples the second token."""
        try:
            request = self._request(job, first_token)
        except BaseException:
            self.release_pages(page_ids)  # refused: the reservation goes back
            raise
        request.cached = cached.moved()
        request.output_ids.append(first_token)
        request.num_computed_tokens = len(request.prompt_ids)
        request.page_ids = page_ids
        if request.text is not None:
            request.text.push(first_token, check_stop=False)  # its text was streamed by the prefill side
        self.scheduler.add_running(request)

    def flush_cache(self) -> None:
        """Make pages written back to disk durable (and visible), and release pins whose TTL
        passed; called when the engine idles."""
        if self.prefix_cache is not None and self.prefix_cache.disk is not None:
            self.prefix_cache.disk.flush()
        if len(self.pins):
            self._expire_pins()

    def purge_tenant(self, cache_salt: str) -> int:
        """Forget every cached page of one tenant, and its pins; returns how many pages."""
        if self.prefix_cache is None:
            return 0
        for pin_id in self.pins.purge(cache_salt.encode()):
            self._drop_pin_request(pin_id)
        return self.prefix_cache.purge(cache_salt.encode())

    # -- pinned prefixes --------------------------------------------------------------------

    def pin_prefix(
        self, pin_id: str, prompt_ids: Sequence[int], cache_salt: str = "", ttl_s: float = 300.0,
        on_done: Callable[[PinView | str], None] | None = None,
    ) -> PinView:
        """Keep the whole pages of a prefix resident here for `ttl_s` seconds (engine.pins):
        held at once when cached, else computed first by an internal request. Pinning an id
        again replaces its pin. RequestError when the prompt or the worker's bound refuses it.
        `on_done` (called on the step thread) gets the pin once held, or why it never was."""
        prompt = tuple(prompt_ids)
        req_id = PIN_REQUEST_PREFIX + pin_id
        self._drop_pin_request(pin_id)  # the same id again replaces the pin, even while it computes
        request = self._request(Job(req_id, prompt, PIN_SAMPLING, cache_salt=cache_salt))
        request.num_shared_pages = self._shared_pages(request.prompt_ids)
        num_pages = len(prompt) // self.cfg.page_size
        hashes = self.scheduler.prefix_hashes(request, num_pages)
        pin = self.pins.add(pin_id, len(prompt), hashes, cache_salt.encode(), ttl_s)
        if on_done is not None:
            pin.waiters.append(on_done)
        if not self.pins.hold(pin, hashes):
            self._pin_requests[req_id] = (pin, hashes)
            self.scheduler.add(request)
        return self.pins.view(pin)

    def unpin_prefix(self, pin_id: str) -> bool:
        """Release a pin (its pages stay cached, unpinned); False if there was none."""
        self._drop_pin_request(pin_id)
        return self.pins.release(pin_id) is not None

    def _pin_outputs(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Take the pins' internal requests out of a step's outputs; hold a pin's pages once
        its request has computed them."""
        kept = []
        for out in outputs:
            computing = self._pin_requests.get(out.req_id)
            if computing is None:
                kept.append(out)
            elif out.finished:
                del self._pin_requests[out.req_id]
                pin, hashes = computing
                if not self.pins.hold(pin, hashes):
                    logger.warning("pin %s: its pages were not all cached after computing them", pin.pin_id)
                    self.pins.release(pin.pin_id, "its pages were not all cached after computing them")
        return kept

    def _drop_pin_request(self, pin_id: str) -> None:
        req_id = PIN_REQUEST_PREFIX + pin_id
        if self._pin_requests.pop(req_id, None) is not None:
            self.abort(req_id)

    def _expire_pins(self) -> None:
        for pin in self.pins.expire():
            self._drop_pin_request(pin.pin_id)

    def check_integrity(self) -> None:
        """Every page reference is accounted for: requests' pages plus the cache's."""
        pages = self.pool.pages
        pages.check_integrity()
        expected = [0] * pages.num_pages
        for request in self.scheduler.running:
            if request.status != RequestStatus.RUNNING:
                raise AssertionError("a request that is not running is in the running list")
            for page_id in request.page_ids:
                expected[page_id] += 1
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
            for page_id in self.prefix_cache.cached_page_ids():
                expected[page_id] += 1
        for page_id in self.pins.held_page_ids():
            expected[page_id] += 1
        for page_id, count in enumerate(expected):
            if pages.refcount(page_id) != count:
                raise AssertionError(f"page {page_id}: refcount {pages.refcount(page_id)}, holders {count}")

    def free_pages_at_idle(self) -> int:
        """Pages that are free or only cached (reusable on demand) when nothing runs."""
        cached = self.prefix_cache.num_cached_pages if self.prefix_cache is not None else 0
        return self.pool.pages.num_free + max(0, cached - self.pins.num_held_pages)  # pinned: not reusable
