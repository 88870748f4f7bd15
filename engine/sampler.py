"""Picks one token per row of a step's logits, batched over the whole step.

Per row, in vLLM / OpenAI order:

    raw logits ── grammar mask (constrained rows: ids the grammar refuses -> -inf)
               ─┬─> log_softmax ──────────────────────────────> logprobs
                └─> logit_bias (each listed id's bias added)
                    repetition penalty (prompt + output ids)
                    presence / frequency penalties (output ids)
                    blocked ids -> -inf
                    ├─ greedy ─> argmax
                    └─ / temperature -> top_k -> top_p -> min_p -> exponential race

Sampling is the exponential race: token = argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d., which
picks token i with probability p_i (the Gumbel-max trick in another form). It needs no sort
and no cumulative sum, and its randomness is one number per (row, token) that does not depend
on the probabilities, so a seeded row draws its E from a generator keyed on (seed, position):
the same request gets the same tokens alone, in any batch, at any row, or after a re-prefill.
The draws are made on the logits' device (no host round trip on CUDA), so a CPU and a GPU
engine draw different numbers for the same key, as their logits differ anyway.

top_p also avoids sorting the vocabulary (a full sort is ~20 ms for 32 x 16k on a CPU): the
race winner j is in the nucleus iff the probability mass strictly above p_j is < top_p; if it
is not, every token no more likely than j is outside the nucleus too, so they are dropped and
the race re-run on the same noise. The result is exactly the race over the nucleus. Rows still
unresolved after a few rounds fall back to a sort.

Logprobs are those of the model's raw distribution (log_softmax of the unprocessed logits,
before penalties, blocked ids and temperature), as vLLM v1 returns by default. A constrained
row's distribution is the raw one renormalised over the tokens its grammar allows, so its
logprobs are finite and its alternatives are tokens the grammar would have taken. Should
blocked ids (min_tokens) leave a constrained row nothing, the grammar's mask alone applies.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from engine.outputs import TokenLogprobs
from engine.sampling import SamplingParams
from kvcache.upload import upload

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_NUCLEUS_ROUNDS = 8  # rejection rounds before the sort fallback; most rows finish in 1-2
# The race reads a test back each round; on these devices top_p sorts instead (engine async
# scheduling queues the sampler while the forward is in flight: a read-back would wait for it).
_SORTED_NUCLEUS_DEVICES = frozenset({"cuda"})
_NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One row of a step's logits: the request's parameters and what the penalties need."""

    params: SamplingParams
    position: int  # index of the token being sampled (the sequence's num_tokens before it)
    output_ids: Sequence[int]  # tokens generated so far (penalties)
    prompt_ids: Sequence[int]  # for repetition_penalty
    blocked_ids: tuple[int, ...]  # ids that must not be sampled now (min_tokens unmet)


class TokenMask(NamedTuple):
    """Which tokens the constrained rows of a step may take (engine.structured fills it)."""

    rows: list[int]  # rows of the step's logits
    bits: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, on the CPU: bit t set = t allowed


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's first maximum. On the CPU through numpy: torch's argmax over a [1, 16k] row
    took 25 us (a reduction set up for many threads), numpy's 1 us; both take the first
    maximum and treat NaN as the largest value."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return logits.numpy().argmax(axis=-1).tolist()  # type: ignore[no-any-return]
    return logits.argmax(dim=-1).tolist()


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _is_plain_greedy(row: SamplingRow) -> bool:
    """Greedy with nothing to report or reweigh: its token is the argmax, unless that argmax
    is one of its blocked ids (min_tokens holding EOS back), which __call__ checks."""
    p = row.params
    return p.is_greedy and p.logprobs is None and not _has_penalties(p) and not p.logit_bias


def deferrable(row: SamplingRow) -> bool:
    """A row whose token the host need not see before the next step is launched: nothing about
    it depends on earlier tokens on the host (penalties, blocked ids, a grammar's mask) and
    nothing is reported beside it (logprobs). A logit_bias does not need the host: its ids and
    values go to the device without a sync, and the deferred path adds them there."""
    p = row.params
    return p.logprobs is None and not _has_penalties(p) and not row.blocked_ids


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> int:
    """The 64-bit generator seed for a seeded row's token at `position`."""
    # Two rounds so that nearby (seed, position) pairs give unrelated streams. torch's CPU
    # generator keeps only the low 32 bits; splitmix64 mixes every input bit into them.
    return _splitmix64(_splitmix64(seed) ^ position)


def _index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return upload(ids, torch.long, device)


def _flat_ids(
    seqs: Sequence[Sequence[int]], row_ids: Sequence[int], vocab: int, *, strict: bool
) -> torch.Tensor:
    """Indices row_ids[k] * vocab + t for every id t of seqs[k], into a flattened [B, V].

    Built on the CPU (the ids arrive as Python ints). With strict, an id outside the
    vocabulary is an error; without, it is dropped.
    """
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    ids = torch.tensor(list(chain.from_iterable(seqs)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.long), lengths)
    valid = (ids >= 0) & (ids < vocab)
    if not bool(valid.all()):
        if strict:
            raise ValueError(f"token id out of range [0, {vocab})")
        ids, rows = ids[valid], rows[valid]
    return rows * vocab + ids


def _apply_penalties(work: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """Repetition, presence and frequency penalties, in place on work (contiguous [B, V]).

    Only the logits of tokens a row has seen change, so this touches those entries and
    never builds a [B, V] count tensor: its cost follows the ids, not the vocabulary.
    """
    vocab, dev = work.shape[1], work.device
    flat = work.view(-1)
    params = [rows[i].params for i in idx]
    outputs = _flat_ids([rows[i].output_ids for i in idx], idx, vocab, strict=True)
    rep_rows = [i for i, p in zip(idx, params, strict=True) if p.repetition_penalty != 1.0]
    if rep_rows:
        rep = torch.ones(work.shape[0])
        rep[rep_rows] = torch.tensor([rows[i].params.repetition_penalty for i in rep_rows])
        prompts = _flat_ids([rows[i].prompt_ids for i in rep_rows], rep_rows, vocab, strict=True)
        seen = torch.unique(torch.cat([prompts, outputs]))
        scale = rep[seen // vocab].to(dev)
        seen = seen.to(dev)
        logit = flat[seen]
        # Divide positive logits, multiply negative ones: both make the token less likely.
        flat[seen] = torch.where(logit > 0, logit / scale, logit * scale)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        freq, pres = torch.zeros(work.shape[0]), torch.zeros(work.shape[0])
        freq[idx] = torch.tensor([p.frequency_penalty for p in params])
        pres[idx] = torch.tensor([p.presence_penalty for p in params])
        tokens, counts = torch.unique(outputs, return_counts=True)
        row = tokens // vocab
        # OpenAI: logit -= frequency_penalty * count + presence_penalty * (count > 0)
        delta = (freq[row] * counts + pres[row]).to(dev)
        tokens = tokens.to(dev)
        flat[tokens] = flat[tokens] - delta


def _apply_bias(work: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """Add each row's logit_bias to its logits, in place on work (contiguous [B, V]): one
    scatter-add for all of them, its size the entries, not the vocabulary; the ids and biases
    travel to the device without a sync (kvcache.upload)."""
    vocab = work.shape[1]
    flat: list[int] = []
    values: list[float] = []
    for i in idx:
        for token, bias in rows[i].params.logit_bias:
            if not 0 <= token < vocab:
                raise ValueError(f"logit_bias: token id {token} out of range [0, {vocab})")
            flat.append(i * vocab + token)
            values.append(bias)
    work.view(-1).index_add_(0, upload(flat, torch.long, work.device), upload(values, work.dtype, work.device))


def _byte_bias() -> npt.NDArray[np.float32]:
    """[256, 8] float32: row b holds 0.0 where bit i of byte b is set, else -inf."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
    return np.where(bits == 1, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


_BYTE_BIAS = _byte_bias()


def _apply_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Add -inf to the tokens the masked rows of logits [B, V] may not take, in place.

    An added float bias, not masked_fill: torch's CPU kernels take ~30x longer over a bool
    mask. On the CPU the bias comes from a byte -> 8 floats table (the bitmask's bytes, in
    little-endian order, are its tokens in order); on a GPU the bits are unpacked there."""
    dev, vocab = logits.device, logits.shape[1]
    num_rows = len(mask.rows)
    if dev.type == "cpu":
        table = np.take(_BYTE_BIAS, mask.bits.numpy().view(np.uint8), axis=0)  # [R, 4W, 8]
        bias = torch.from_numpy(table.reshape(num_rows, -1)[:, :vocab])
    else:
        words = mask.bits.to(dev, non_blocking=True)  # [R, W]
        shifts = torch.arange(32, dtype=torch.int32, device=dev)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1)[:, :vocab]  # [R, V]
        bias = torch.zeros(allowed.shape, device=dev).masked_fill_(allowed == 0, _NEG_INF)
    with torch.inference_mode():  # the forward pass's logits are inference tensors
        logits.index_add_(0, _index(mask.rows, dev), bias.to(logits.dtype))


def _apply_blocked(work: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """Blocked ids -> -inf, in place on work (contiguous [B, V])."""
    # An id beyond the vocabulary (a user's stop_token_ids) can never be sampled anyway.
    blocked = _flat_ids([rows[i].blocked_ids for i in idx], idx, work.shape[1], strict=False)
    work.view(-1).index_fill_(0, blocked.to(work.device), _NEG_INF)


# torch's CPU kernels read bool masks several times slower than they do float math, so the
# per-token filters below are float 0/1 masks built arithmetically (same result on CUDA).
def _mask_gt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1.0 where a > b, else 0.0."""
    return (a - b).relu_().sign_()


def _mask_ge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1.0 where a >= b, else 0.0."""
    return (a - b).sign_().add_(1.0).clamp_(max=1.0)


def _apply_top_k(probs: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Zero all but each row's top_k probabilities (ties with the k-th kept), in place."""
    vocab = probs.shape[1]
    sel = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if not sel:
        return
    top_ks = [params[i].top_k for i in sel]
    ks = _index(top_ks, probs.device)
    rows = _index(sel, probs.device)
    sub = probs[rows]  # [R, V]
    # the widest k from the host's copy: reading it off the device would wait for the step
    kth = sub.topk(max(top_ks), dim=-1).values.gather(1, (ks - 1)[:, None])  # [R, 1]
    probs[rows] = sub * _mask_ge(sub, kth)


def _apply_min_p(
    score: torch.Tensor, probs: torch.Tensor, params: Sequence[SamplingParams]
) -> None:
    """Zero the score of tokens with p < min_p * max p, in place."""
    sel = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if not sel:
        return
    rows = _index(sel, probs.device)
    min_p = upload([params[i].min_p for i in sel], torch.float32, probs.device)[:, None]
    sub = probs[rows]  # [R, V]
    score[rows] = score[rows] * _mask_ge(sub, sub.amax(dim=-1, keepdim=True) * min_p)


def _nucleus_race(score: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """argmax of score over each row's top-p nucleus of probs, without sorting.      [R]

    probs may be unnormalised (top_k zeroed some); score = probs / E, possibly with more
    zeros (min_p), but positive for each row's most likely token.
    """
    out = torch.empty(score.shape[0], dtype=torch.long, device=score.device)
    active = torch.arange(score.shape[0], device=score.device)
    limit = top_p * probs.sum(dim=-1)  # [R]
    for _ in range(_NUCLEUS_ROUNDS):
        j = score.argmax(dim=-1, keepdim=True)  # [R, 1]
        pj = probs.gather(1, j)
        above = _mask_gt(probs, pj).mul_(probs).sum(dim=-1)  # mass more likely than j
        ok = above < limit
        out[active[ok]] = j[ok, 0]
        if bool(ok.all()):
            return out
        keep = ~ok
        active, pj, limit = active[keep], pj[keep], limit[keep]
        score, probs = score[keep], probs[keep]
        # j is outside the nucleus, and so is every token no more likely than j.
        score *= _mask_gt(probs, pj)
    logger.debug("top_p: %d rows fell back to a sort", active.numel())
    out[active] = _nucleus_sorted(score, probs, limit)
    return out


def _nucleus_sorted(score: torch.Tensor, probs: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """The same as `_nucleus_race` (limit = top_p * mass), by sorting each row: no read-back.

    A token is in the nucleus when the mass of the tokens strictly more likely than it is below
    the limit, as in the race; tied tokens share the mass before their tie group, so a tie at
    the edge is kept or dropped whole."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ahead = sorted_p.cumsum(dim=-1).roll(1, dims=-1)
    ahead[:, 0] = 0.0  # the mass sorted before each token (a cumulative sum never decreases)
    first = torch.ones_like(sorted_p, dtype=torch.bool)
    first[:, 1:] = sorted_p[:, 1:] != sorted_p[:, :-1]  # where a tie group starts
    above = torch.where(first, ahead, torch.zeros_like(ahead)).cummax(dim=-1).values
    drop = torch.empty_like(first).scatter_(1, order, above >= limit[:, None])
    return score.masked_fill(drop, 0.0).argmax(dim=-1)


def _nucleus(score: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """argmax of score over each row's top-p nucleus: by the race on the CPU (the fewest
    passes), by the sort where a read-back would stall a device in flight (CUDA)."""
    if score.device.type in _SORTED_NUCLEUS_DEVICES:
        return _nucleus_sorted(score, probs, top_p * probs.sum(dim=-1))
    return _nucleus_race(score, probs, top_p)


class Sampler:
    """Samples a step's tokens; one per engine, reused every step."""

    def __init__(self, vocab_size: int, *, seed: int | None = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self._seed = seed  # for unseeded rows; None draws a fresh seed per device
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], mask: TokenMask | None = None
    ) -> SamplerOutput:
        """logits [B, V>=vocab_size]; columns past vocab_size (lm_head padding) are ignored.
        `mask` limits its rows to the tokens their grammars allow (in place, on logits)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab {self.vocab_size}")
        logits = logits[:, : self.vocab_size]
        if not rows:
            return SamplerOutput([], [])
        if mask is not None:
            _apply_mask(logits, mask)
        if all(_is_plain_greedy(r) for r in rows):
            # argmax is exact in any float dtype, so no cast is needed. Blocking ids only lowers
            # them, so an argmax that is not blocked is the blocked argmax too (ties included:
            # argmax takes the first maximum); the benchmark's min_tokens rows then skip the
            # copy and fill of every row's logits (~12% of a baton-tiny decode step at c=8).
            argmax = _argmax_rows(logits)
            if not any(token in row.blocked_ids for token, row in zip(argmax, rows, strict=True)):
                return SamplerOutput(argmax, [None] * len(rows))
        raw = logits.float()
        tokens = self._choose(self._processed(raw, rows), rows)
        token_ids: list[int] = tokens.tolist()
        return SamplerOutput(token_ids, _logprobs(raw, rows, tokens, token_ids))

    def sample_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Token ids [S] left on the logits' device: engine async scheduling feeds them to the
        next step on the device and reads them back a step later. Only for rows `deferrable`
        accepts; their tokens (and the generator's draws) are exactly what __call__ returns
        for them. No row waits for the device on CUDA (top_p sorts there); on the CPU, where
        nothing runs beside the host, top_p's race reads a test back each round."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not all(deferrable(r) for r in rows):
            raise ValueError("a row needs its tokens on the host (mask, logprobs, penalties or blocked ids)")
        logits = logits[:, : self.vocab_size]
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        if biased:  # as _processed does it, so the tokens are __call__'s
            logits = logits.clone(memory_format=torch.contiguous_format)
            _apply_bias(logits, rows, biased)
        if all(r.params.is_greedy for r in rows):
            return logits.argmax(dim=-1)
        return self._choose(logits.float(), rows)

    def _choose(self, work: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Token ids [S] from processed float32 logits: argmax for greedy rows, the sampler's
        draw for the others (one generator call for all of them, so the draws do not depend on
        which entry point asked)."""
        tokens = torch.empty(len(rows), dtype=torch.long, device=work.device)
        greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
        if greedy:
            g = _index(greedy, work.device)
            tokens.index_copy_(0, g, work.index_select(0, g).argmax(dim=-1))
        if len(greedy) < len(rows):
            sample = [i for i, r in enumerate(rows) if not r.params.is_greedy]
            tokens.index_copy_(0, _index(sample, work.device), self._sample(work, rows, sample))
        return tokens

    def _processed(self, raw: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Logits after logit_bias, penalties and blocked ids, in that order; raw itself when no
        row has any."""
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        penalized = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
        blocked = [i for i, r in enumerate(rows) if r.blocked_ids]
        if not biased and not penalized and not blocked:
            return raw
        work = raw.clone(memory_format=torch.contiguous_format)
        if biased:
            _apply_bias(work, rows, biased)
        if penalized:
            _apply_penalties(work, rows, penalized)
        if blocked:
            _apply_blocked(work, rows, blocked)
            # min_tokens may block the one token a grammar allows (EOS): then the grammar wins.
            b = _index(blocked, raw.device)
            dead = work.index_select(0, b).isneginf().all(dim=-1)
            if bool(dead.any()):
                b = b[dead]
                work.index_copy_(0, b, raw.index_select(0, b))
        return work

    def _sample(
        self, work: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]
    ) -> torch.Tensor:
        """Token ids for the non-greedy rows `idx`.                                    [S]"""
        dev = work.device
        params = [rows[i].params for i in idx]
        temps = upload([p.temperature for p in params], torch.float32, dev)[:, None]
        if len(idx) == work.shape[0]:
            x = work / temps
        else:
            x = work[_index(idx, dev)].div_(temps)
        probs = x.softmax(dim=-1)  # [S, V]
        del x
        _apply_top_k(probs, params)
        # The exponential race: argmax p / E picks token i with probability p_i.
        score = self._exponential(probs.shape, rows, idx, dev)
        torch.div(probs, score, out=score)
        _apply_min_p(score, probs, params)
        nucleus = [k for k, p in enumerate(params) if p.top_p < 1.0]
        if not nucleus:
            return score.argmax(dim=-1)
        top_p = upload([params[k].top_p for k in nucleus], torch.float32, dev)
        if len(nucleus) == len(idx):
            return _nucleus(score, probs, top_p)
        tokens = score.argmax(dim=-1)
        n = _index(nucleus, dev)
        tokens[n] = _nucleus(score[n], probs[n], top_p)  # top_p sees top_k, not min_p
        return tokens

    def _exponential(
        self, shape: torch.Size, rows: Sequence[SamplingRow], idx: list[int], dev: torch.device
    ) -> torch.Tensor:
        """E ~ Exp(1) i.i.d.; a seeded row's from a generator keyed on (seed, position).  [S, V]"""
        u = torch.empty(shape, device=dev)
        seeded = [k for k, i in enumerate(idx) if rows[i].params.seed is not None]
        if len(seeded) < len(idx):
            if not seeded:
                u.uniform_(generator=self._generator(dev))
            else:
                unseeded = [k for k, i in enumerate(idx) if rows[i].params.seed is None]
                draw = torch.empty((len(unseeded), shape[1]), device=dev)
                u[_index(unseeded, dev)] = draw.uniform_(generator=self._generator(dev))
        for k in seeded:
            row = rows[idx[k]]
            gen = torch.Generator(device=dev)
            gen.manual_seed(row_key(row.params.seed or 0, row.position))
            u[k].uniform_(generator=gen)  # a whole contiguous row: the same draws at any k
        # u is in [0, 1); the clamp keeps E finite (E = -log u in (0, 87]) so that p / E is
        # never NaN and the most likely token's score is always positive.
        return u.clamp_(min=torch.finfo(u.dtype).tiny).log_().neg_()

    def _generator(self, dev: torch.device) -> torch.Generator:
        gen = self._generators.get(dev)
        if gen is None:
            gen = torch.Generator(device=dev)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[dev] = gen
        return gen


def _logprobs(
    raw: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor, token_ids: list[int]
) -> list[TokenLogprobs | None]:
    """The sampled token's logprob and the top alternatives, from the raw logits."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not idx:
        return out
    rows_t = _index(idx, raw.device)
    lp = raw.index_select(0, rows_t).log_softmax(dim=-1)  # [L, V]
    chosen = lp.gather(1, tokens.index_select(0, rows_t)[:, None])[:, 0].tolist()
    num_top = [min(rows[i].params.logprobs or 0, raw.shape[1]) for i in idx]
    top_v: list[list[float]] = [[] for _ in idx]
    top_i: list[list[int]] = [[] for _ in idx]
    if max(num_top) > 0:
        top = lp.topk(max(num_top), dim=-1)
        top_v, top_i = top.values.tolist(), top.indices.tolist()
    for k, i in enumerate(idx):
        n = num_top[k]
        # A constrained row may allow fewer tokens than asked for: no -inf alternatives.
        alts = tuple((t, v) for t, v in zip(top_i[k][:n], top_v[k][:n], strict=True) if v != _NEG_INF)
        out[i] = TokenLogprobs(token_ids[i], chosen[k], alts)
    return out
