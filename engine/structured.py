"""Structured output: per-step token masks that keep constrained requests inside their grammar.

    add_request     new_matcher(constraint): the compiled grammar from the cache (or compiled
                    now, off the step thread, within a wall-clock bound); a refusal is a
                    ConstraintError before any KV page is allocated
    step            start(scheduled): the masks of every constrained request that samples this
                    step are filled, beside the forward pass where that helps (see Overlap)
                    runner: the sampler applies them to the logits (greedy, sampled, logprobs)
                    update: GrammarMatcher.advance(token); grammar complete -> finish "stop"

A matcher's state is a function of the request's output tokens alone, and it advances exactly
when a token is appended to `output_ids`, so preemption (recompute keeps the outputs) and
prefix-cache hits (they only change where KV comes from) leave it right. The prefill/decode
hand-off samples the first token under the mask on the prefill side; the decode side builds
a fresh matcher and advances it by that token (Engine.add_prefilled). A request that moved
(its decode worker was lost) arrives with the tokens it already emitted at the end of its
prompt (Job.num_resumed): both sides advance the fresh matcher over them first
(GrammarMatcher.resume), so the mask goes on where the lost worker's stopped.

The library: llguidance (pinned llguidance==1.9.1). Measured on baton-tiny's tokenizer
(16,384-token byte-level BPE), this machine's 2 cores, three schemas (2-property object;
nested objects + enum + array + patterns; 50 properties), two regexes and "any JSON object";
mask time for 32 matchers filled together along a random valid path, p50 / p99:

    library        compile (per schema)   mask, batch 32              notes
    llguidance     0.3 - 1.5 ms           0.1 - 0.9 / 1 - 4 ms        no tokenizer-wide precompute
    xgrammar       0.5 - 37 ms            0.1 - 0.6 / 3 - 13 ms       C++ paths in its errors
    outlines-core  5 - 128 ms             0.05 - 0.6 / 0.1 - 0.8 ms   regex-only: no recursive JSON,
                                                                     no grammars, full DFA per schema

llguidance wins on what matters here: compile is ~1 ms (nothing tokenizer-wide is precomputed;
the lexer is built lazily from regex derivatives), so a cache miss is cheap; masks for a batch
of 32 cost well under a millisecond; it was built for untrusted grammars — every step is bounded
by fuel limits (lexer fuel, Earley items, lexer states, grammar size) and a resource or grammar
error puts the matcher in an error state instead of raising or hanging: `(.*a){20}` and
`(a+)+$` cost ~1 ms, an invalid schema is a one-line message; it releases the GIL while it
compiles and fills masks, so both run beside the forward pass; it ships type hints and depends
on nothing. xgrammar's masks are as fast but its compile precomputes per-token tables (tens of
ms here, more on a 128k vocabulary); outlines-core compiles each schema to a full DFA over the
vocabulary and cannot express recursive JSON at all.

Limits against abuse, in order: the constraint's own bounds (engine.constraint: size, depth,
regex expansion); llguidance's parser limits; `compile_timeout_s` on the compile (a compile
that overruns is refused and remembered as refused); compiles run on their own threads, so
the step thread only waits for one when nobody called `prepare` first (AsyncEngine does, on
the event loop's executor); the cache keeps both compiled grammars and refusals (LRU), so a
repeated hostile constraint costs a dictionary lookup. A matcher that still hits a limit
mid-request ends that request (finish "abort"); the batch goes on.

Overlap: llguidance releases the GIL while it fills masks, so `start` runs the fill on a
thread while the step thread runs the forward pass. That pays wherever the CPU would otherwise
wait — on a GPU, or with a core the forward's threads leave free — and `overlap=None` (the
default) turns it on exactly there. `python -m bench.structured` (baton-tiny in-process,
concurrency 32, every other request under a four-object JSON schema, 64 tokens each; the
median of interleaved runs on this shared 2-core machine), ITL p50 / p99:

    torch threads   none              half constrained, overlapped   half, serial
    1 (a core free) 18.9 / 27.5 ms    19.2 / 27.1 ms  (+1.6%)        19.5 / 27.8 ms  (+3.4%)
    2 (all cores)   17.0 / 23.4 ms    19.1 / 30.1 ms  (+12.3%)       19.0 / 38.8 ms  (+11.4%)

With every core in the forward, the fill's ~0.5 ms of CPU per step (16 matchers) has nowhere
to hide: overlapped, it slows the forward by as much. The rest of the cost is small: the mask
is applied as an added float bias (~0.1 ms for 16 x 16k; masked_fill over a bool mask takes
~30x longer on CPU), and advancing 16 matchers takes ~0.07 ms.

JSON is generated compactly, with the separators ", " and ": " and no other whitespace
between tokens: with free whitespace a weak model can pad forever. A request that reaches
max_tokens before its grammar completes ends with finish "length" and its output may be
truncated JSON (as in vLLM and OpenAI's API). When the grammar completes, the request stops
(finish "stop") whatever min_tokens or ignore_eos say.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.constraint import Constraint, ConstraintError, ConstraintKind
from engine.request import FinishReason, Request
from engine.sampler import TokenMask
from engine.structured_config import StructuredConfig

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)

# Compact JSON: no free whitespace (see the module docstring). Passed as llguidance's
# "overrides", so a schema's own "x-guidance" options cannot switch it back on.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_MAX_MESSAGE = 400  # characters of a compiler message passed on to the client
_WHAT = {
    ConstraintKind.JSON_OBJECT: "JSON object grammar",
    ConstraintKind.JSON_SCHEMA: "JSON schema",
    ConstraintKind.REGEX: "regex",
    ConstraintKind.GRAMMAR: "grammar",
}


class GrammarMatcher:
    """One request's position in its grammar, advanced by every token it generates."""

    __slots__ = ("ll",)

    def __init__(self, ll: llguidance.LLMatcher) -> None:
        self.ll = ll

    def advance(self, token: int) -> FinishReason | None:
        """Consume the sampled token: STOP once the grammar is complete (nothing but EOS can
        follow), ABORT when the matcher failed (a token outside the mask, a resource limit)."""
        if not self.ll.consume_token(token) or self.ll.is_error():
            logger.warning("constrained decoding failed: %s", self.ll.get_error()[:_MAX_MESSAGE])
            return FinishReason.ABORT
        return FinishReason.STOP if self.ll.is_stopped() else None

    def resume(self, tokens: Sequence[int]) -> FinishReason | None:
        """Consume output the request already has, generated elsewhere under the same grammar
        (a migrated request's): what `advance` says of the last token, or ABORT at the first
        one the grammar refuses. STOP leaves the matcher where only EOS can follow."""
        reason: FinishReason | None = None
        for token in tokens:
            reason = self.advance(token)
            if reason == FinishReason.ABORT:
                break
        return reason


class _Compiled(NamedTuple):
    template: llguidance.LLMatcher | None  # at the grammar's start; requests get copies
    error: str  # why it was refused, when template is None


class GrammarCompiler:
    """Constraint -> compiled grammar, on its own threads, bounded in time, cached (LRU).

    Thread-safe: the edge's executor (prepare) and the step thread (matcher) both call it."""

    def __init__(
        self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: Sequence[int], cfg: StructuredConfig
    ) -> None:
        self.cfg = cfg
        self._tokenizer_json = tokenizer_json  # called once, on the first constraint
        self._vocab_size = vocab_size
        self._eos_ids = list(eos_ids)
        self._pool = cf.ThreadPoolExecutor(cfg.num_compile_threads, thread_name_prefix="baton-grammar")
        # Reentrant: a future that is already done runs its callback (_settle) at once.
        self._lock = threading.RLock()
        self._tokenizer: cf.Future[llguidance.LLTokenizer] | None = None
        self._cache: OrderedDict[Constraint, _Compiled] = OrderedDict()
        self._pending: dict[Constraint, cf.Future[_Compiled]] = {}
        self._overran: set[Constraint] = set()

    def is_cached(self, constraint: Constraint) -> bool:
        with self._lock:
            return constraint in self._cache

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher at the start of `constraint`'s grammar; ConstraintError if refused."""
        template = self.compile(constraint)
        with self._lock:  # a copy shares the compiled grammar and lexer: ~1 us
            return GrammarMatcher(template.deep_copy())

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        self.tokenizer()  # built once, outside the bound (a second on a 128k vocabulary)
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return _unwrap(constraint, hit)
            future = self._pending.get(constraint)
            if future is None:
                future = self._pool.submit(self._build, constraint)
                self._pending[constraint] = future
                future.add_done_callback(lambda f: None if f.cancelled() else self._settle(constraint, f))
        try:
            future.result(timeout=self.cfg.compile_timeout_s)
        except cf.TimeoutError:
            with self._lock:
                if not future.done():
                    self._overran.add(constraint)  # remembered as refused once it finishes
                    raise ConstraintError(_overran(constraint, self.cfg.compile_timeout_s)) from None
        return _unwrap(constraint, self._settle(constraint, future))

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(self._build_tokenizer)
            future = self._tokenizer
        try:
            return future.result()
        except ImportError:
            raise ConstraintError("structured output needs the llguidance package on this worker") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        return llguidance.LLTokenizer(self._tokenizer_json(), n_vocab=self._vocab_size, eos_token=self._eos_ids)

    def _build(self, constraint: Constraint) -> _Compiled:
        """Compile on a pool thread (llguidance drops the GIL); never raises."""
        import llguidance

        try:
            grammar = _grammar(constraint)
            limits = llguidance.LLParserLimits(verbose_errors=False)
            matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=limits)
            if not matcher.is_error():
                matcher.compute_bitmask()  # build the lexer's first states here, not on the step
        except Exception as exc:  # a library error about this constraint, whatever its type
            return _Compiled(None, str(exc))
        if matcher.is_error():
            return _Compiled(None, matcher.get_error())
        return _Compiled(matcher, "")

    def _settle(self, constraint: Constraint, future: cf.Future[_Compiled]) -> _Compiled:
        """Move a finished compile into the cache (once; both the waiter and the future's
        callback call this) and return what the cache holds for it."""
        compiled = future.result()
        with self._lock:
            if self._pending.get(constraint) is not future:
                return self._cache.get(constraint, compiled)
            del self._pending[constraint]
            if constraint in self._overran:
                self._overran.discard(constraint)
                compiled = _Compiled(None, "")
            self._cache[constraint] = compiled
            while len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
            return compiled


def _grammar(constraint: Constraint) -> str:
    """llguidance's grammar text for a constraint."""
    import llguidance

    make = llguidance.LLMatcher
    kind = constraint.kind
    if kind == ConstraintKind.JSON_OBJECT:
        return make.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if kind == ConstraintKind.JSON_SCHEMA:
        schema = json.loads(constraint.text)
        schema.pop("x-guidance", None)  # a library's own knobs are not part of the API
        return make.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    if kind == ConstraintKind.REGEX:
        return make.grammar_from_regex(constraint.text)
    return make.grammar_from_lark(constraint.text)


def _unwrap(constraint: Constraint, compiled: _Compiled) -> llguidance.LLMatcher:
    if compiled.template is not None:
        return compiled.template
    what = _WHAT[ConstraintKind(constraint.kind)]
    if not compiled.error:
        raise ConstraintError(_overran(constraint, None))
    message = " ".join(compiled.error.split())[:_MAX_MESSAGE]
    raise ConstraintError(f"the {what} does not compile: {message}")


def _overran(constraint: Constraint, timeout_s: float | None) -> str:
    what = _WHAT[ConstraintKind(constraint.kind)]
    bound = f" {timeout_s:g} s" if timeout_s is not None else " its time bound"
    return f"the {what} is too complex: it took longer than{bound} to compile"


class MaskJob:
    """The masks of one step's constrained requests, being filled (or filled)."""

    def __init__(self, requests: list[Request], bits: torch.Tensor, future: cf.Future[None] | None) -> None:
        self.requests = requests
        self.bits = bits  # [len(requests), ceil(vocab / 32)] int32
        self.future = future

    def wait(self, sampled: Sequence[tuple[Request, int]]) -> TokenMask | None:
        """The masks, as rows of the step's logits (`sampled`: request -> row)."""
        if self.future is not None:
            self.future.result()
        index = {request: k for k, request in enumerate(self.requests)}
        rows: list[int] = []
        src: list[int] = []
        for request, row in sampled:
            k = index.get(request)
            if k is not None:
                rows.append(row)
                src.append(k)
        if not rows:
            return None
        bits = self.bits if src == list(range(len(self.requests))) else self.bits[src]
        return TokenMask(rows, bits)


class StructuredOutputs:
    """The engine's structured-output strategy: compiles constraints, fills each step's masks."""

    def __init__(
        self,
        tokenizer_json: Callable[[], str],
        vocab_size: int,
        eos_ids: Sequence[int],
        cfg: StructuredConfig | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.cfg = cfg or StructuredConfig()
        self.vocab_size = vocab_size
        self.compiler = GrammarCompiler(tokenizer_json, vocab_size, eos_ids, self.cfg)
        device = device or torch.device("cpu")
        self._pin_memory = device.type == "cuda"  # the masks' copy to the GPU can be async
        self._width = (vocab_size + 31) // 32
        self._executor: llguidance.LLExecutor | None = None
        self._thread: cf.ThreadPoolExecutor | None = None
        if self.cfg.resolve_overlap(device):
            self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="baton-mask")

    def prepare(self, constraint: Constraint) -> None:
        """Compile now (any thread): what the edge calls so the step thread never compiles."""
        self.compiler.compile(constraint)

    def new_matcher(self, constraint: Constraint) -> GrammarMatcher:
        return self.compiler.matcher(constraint)

    def start(self, scheduled: Sequence[tuple[Request, int]]) -> MaskJob | None:
        """Begin filling the masks of the constrained requests that sample this step (those
        whose computed tokens catch up); None when there are none."""
        requests = [r for r, n in scheduled if r.matcher is not None and r.num_computed_tokens + n == r.num_tokens]
        if not requests:
            return None
        bits = torch.empty((len(requests), self._width), dtype=torch.int32, pin_memory=self._pin_memory)
        if self._thread is None:
            self._fill(requests, bits)
            return MaskJob(requests, bits, None)
        return MaskJob(requests, bits, self._thread.submit(self._fill, requests, bits))

    def _fill(self, requests: list[Request], bits: torch.Tensor) -> None:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=self.cfg.mask_threads)
        matchers = [(r.matcher.ll, k) for k, r in enumerate(requests) if r.matcher is not None]
        self._executor.unsafe_compute_mask_ptr(matchers, bits.data_ptr(), self._width * 4, len(requests))

    def close(self) -> None:
        self.compiler.close()
        if self._thread is not None:
            self._thread.shutdown(wait=False)
