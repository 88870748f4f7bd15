"""Sampler: greedy, filters, penalties, seeded determinism, distribution and logprobs.

Every random input comes from a fixed seed, so each test is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from engine import sampler as sampler_mod
from engine.sampler import Sampler, SamplingRow, row_key
from engine.sampling import SamplingParams

V = 64


def randn(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen) * scale


def row(
    params: SamplingParams,
    position: int = 0,
    output: Sequence[int] = (),
    prompt: Sequence[int] = (),
    blocked: tuple[int, ...] = (),
) -> SamplingRow:
    return SamplingRow(params, position, list(output), list(prompt), blocked)


GREEDY = SamplingParams(temperature=0.0)


def sample_many(logits_row: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """n draws for one logits row: n seeded requests (seeds 0..n-1), one batch."""
    rows = [row(replace(params, seed=s), position=3) for s in range(n)]
    out = Sampler(logits_row.shape[0])(logits_row.expand(n, -1).contiguous(), rows)
    return out.token_ids


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.shape[0]).double()
    expected = probs.double() * len(tokens)
    assert bool((counts[expected == 0] == 0).all()), "a zero-probability token was sampled"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# --- greedy and filters -------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = randn(8, V)
    out = Sampler(V)(logits, [row(GREEDY)] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_takes_the_first_maximum_and_nan_as_torch_does() -> None:
    """The CPU fast path's argmax (numpy's) against torch's: ties, NaN, -inf, a strided view."""
    logits = randn(6, V)
    logits[0, 3] = logits[0, 9] = logits[0].max() + 1.0  # a tie: the first
    logits[1, 5] = float("nan")  # NaN counts as the largest, as in torch
    logits[2] = float("-inf")  # every token blocked: the first
    logits[3, V - 1] = float("inf")
    out = Sampler(V)(logits, [row(GREEDY)] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[:4] == [3, 5, 0, V - 1]
    strided = randn(4, 2 * V)[:, ::2]
    assert Sampler(V)(strided, [row(GREEDY)] * 4).token_ids == strided.argmax(-1).tolist()


def test_logit_bias_bans_a_token_at_temperature_one_and_forces_one_greedily() -> None:
    logits = randn(V, seed=5)
    logits[5] = logits.max() + 6.0  # the likeliest token by far: most draws take it
    free = sample_many(logits, SamplingParams(temperature=1.0), 400)
    assert free.count(5) > 300
    banned = sample_many(logits, SamplingParams(temperature=1.0, logit_bias={5: -100}), 400)
    assert 5 not in banned and len(set(banned)) > 5
    forced = Sampler(V)(logits[None].contiguous(), [row(SamplingParams(temperature=0.0, logit_bias={11: 100}))])
    assert forced.token_ids == [11]


def test_logit_bias_is_per_row_and_logprobs_stay_the_models() -> None:
    logits = randn(3, V, seed=6)
    params = SamplingParams(temperature=0.0, logprobs=0)
    rows = [row(params), row(replace(params, logit_bias={7: 100.0})), row(params)]
    out = Sampler(V)(logits.clone(), rows)
    plain = logits.argmax(-1).tolist()
    assert out.token_ids == [plain[0], 7, plain[2]]
    expected = torch.log_softmax(logits[1], -1)[7].item()  # the raw distribution's, as vLLM v1 reports
    assert out.logprobs[1] is not None and abs(out.logprobs[1].logprob - expected) < 1e-5
    assert not sampler_mod.deferrable(rows[1]) and sampler_mod.deferrable(row(GREEDY))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_in_half_precision(dtype: torch.dtype) -> None:
    logits = randn(4, V).to(dtype)
    expected = logits.float().argmax(-1).tolist()
    assert Sampler(V)(logits, [row(GREEDY)] * 4).token_ids == expected  # fast path
    slow = [row(SamplingParams(temperature=0.0, logprobs=0))] * 4  # casts to float32
    assert Sampler(V)(logits, slow).token_ids == expected


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = randn(6, V, seed=1)
    rows = [row(GREEDY), row(SamplingParams(seed=1)), row(GREEDY, position=9)] * 2
    out = Sampler(V, seed=0)(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 3, 5)] == [argmax[i] for i in (0, 2, 3, 5)]


def test_greedy_rows_with_blocked_ids_take_the_best_unblocked_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """min_tokens blocks EOS on greedy rows: the argmax when it is not blocked (no copy of the
    logits), the best unblocked token when it is, and a tie with a blocked id is not a win."""
    copies: list[int] = []
    real = sampler_mod._apply_blocked

    def counted(*args: object) -> None:
        copies.append(1)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler_mod, "_apply_blocked", counted)
    logits = randn(3, V, seed=4)
    best = logits.argmax(-1).tolist()
    second = logits.topk(2).indices[:, 1].tolist()
    rows = [row(GREEDY, blocked=(second[0],)), row(GREEDY, blocked=(V + 3,)), row(GREEDY)]
    assert Sampler(V)(logits, rows).token_ids == best
    assert not copies  # no row's argmax was blocked: the fast path
    rows[1] = row(GREEDY, blocked=(best[1],))
    assert Sampler(V)(logits, rows).token_ids == [best[0], second[1], best[2]]
    assert copies
    tied = logits.clone()
    tied[2, 0] = tied[2, 1] = tied[2].max() + 1.0  # ids 0 and 1 tie; argmax takes 0, which is blocked
    out = Sampler(V)(tied, [row(GREEDY), row(GREEDY), row(GREEDY, blocked=(0,))]).token_ids
    assert out[2] == 1


def test_blocked_ids_are_never_sampled() -> None:
    logits = randn(1, V, seed=2)
    top = logits[0].topk(3).indices.tolist()
    logits[0, top] += 20.0  # the blocked ids are by far the most likely
    blocked = (*top, V + 5)  # an id past the vocabulary is ignored, not an error
    greedy = Sampler(V)(logits, [row(GREEDY, blocked=blocked)]).token_ids[0]
    assert (
        greedy
        == logits[0].masked_fill(torch.isin(torch.arange(V), torch.tensor(top)), -1e9).argmax()
    )
    rows = [row(SamplingParams(seed=s, temperature=2.0), blocked=blocked) for s in range(300)]
    tokens = Sampler(V)(logits.expand(300, -1), rows).token_ids
    assert not set(tokens) & set(top)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.5, min_p=1.0),
        SamplingParams(temperature=1.5, top_k=5, top_p=1e-6, min_p=0.3),
    ],
    ids=["top_k=1", "top_p tiny", "min_p=1", "all"],
)
def test_filters_that_keep_one_token_are_greedy(params: SamplingParams) -> None:
    logits = randn(16, V, seed=3)
    rows = [row(replace(params, seed=s), s) for s in range(8)]
    rows += [row(params, s) for s in range(8)]  # unseeded rows too
    assert Sampler(V, seed=5)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_k_samples_only_the_top_k() -> None:
    logits = randn(V, seed=4, scale=0.5)  # flat: many tokens are likely
    tokens = sample_many(logits, SamplingParams(top_k=5), 2000)
    assert set(tokens) <= set(logits.topk(5).indices.tolist())
    assert len(set(tokens)) == 5


def test_min_p_drops_unlikely_tokens() -> None:
    logits = randn(V, seed=5, scale=1.0)
    params = SamplingParams(temperature=0.7, min_p=0.3)
    probs = (logits / 0.7).softmax(-1)
    allowed = set((probs >= 0.3 * probs.max()).nonzero()[:, 0].tolist())
    tokens = sample_many(logits, params, 2000)
    assert set(tokens) <= allowed
    assert len(set(tokens)) > 1


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference: the smallest most-likely set with mass >= top_p, renormalised."""
    sorted_p, order = probs.sort(descending=True)
    keep = (sorted_p.cumsum(0) - sorted_p) < top_p
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


@pytest.fixture(params=["race", "sort"])
def nucleus_method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """top_p by the race (the CPU's) or by the sort (CUDA's), both run here."""
    if request.param == "sort":
        monkeypatch.setattr(sampler_mod, "_SORTED_NUCLEUS_DEVICES", frozenset({"cpu"}))
    return str(request.param)


def test_top_p_distribution_matches_the_nucleus(nucleus_method: str) -> None:
    logits = randn(V, seed=6, scale=1.5)
    params = SamplingParams(temperature=0.8, top_p=0.7)
    expected = nucleus((logits / 0.8).softmax(-1), 0.7)
    tokens = sample_many(logits, params, 4000)
    # df = |nucleus| - 1; 3 * df is far beyond the 99.9% quantile for these sizes.
    df = int((expected > 0).sum()) - 1
    assert df > 3
    assert chi_square(tokens, expected) < 3 * df + 10


def test_top_k_then_top_p_distribution(nucleus_method: str) -> None:
    logits = randn(V, seed=7, scale=1.0)
    params = SamplingParams(top_k=10, top_p=0.8)
    probs = logits.softmax(-1)
    top10 = torch.zeros_like(probs)
    idx = probs.topk(10).indices
    top10[idx] = probs[idx]
    expected = nucleus(top10 / top10.sum(), 0.8)
    tokens = sample_many(logits, params, 4000)
    df = int((expected > 0).sum()) - 1
    assert chi_square(tokens, expected) < 3 * df + 10


def test_nucleus_race_equals_the_sort() -> None:
    probs = randn(64, 500, seed=8, scale=2.0).softmax(-1)
    gen = torch.Generator().manual_seed(9)
    score = probs / torch.empty_like(probs).exponential_(generator=gen)
    top_p = torch.rand(64, generator=gen) * 0.98 + 0.01
    race = sampler_mod._nucleus_race(score, probs, top_p)
    assert race.tolist() == sampler_mod._nucleus_sorted(score, probs, top_p).tolist()


def test_a_tie_at_the_nucleus_edge_is_kept_whole_by_the_race_and_the_sort() -> None:
    # p = [.4, .2, .2, .2], top_p = .5: the three tied tokens each have .4 ahead of them, below
    # .5, so all are in; a sort that cut inside the tie would keep only the first of them.
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.2]] * 3)
    score = torch.tensor([[0.1, 0.2, 0.3, 0.9], [0.1, 0.9, 0.3, 0.2], [0.9, 0.1, 0.1, 0.1]])
    top_p = torch.full((3,), 0.5)
    want = [3, 1, 0]
    assert sampler_mod._nucleus_race(score, probs, top_p).tolist() == want
    assert sampler_mod._nucleus_sorted(score, probs, top_p).tolist() == want
    # just below the tie's mass ahead: only the most likely token
    assert sampler_mod._nucleus_sorted(score, probs, torch.full((3,), 0.4)).tolist() == [0, 0, 0]
    assert sampler_mod._nucleus_race(score, probs, torch.full((3,), 0.4)).tolist() == [0, 0, 0]


def test_the_sorted_nucleus_equals_the_race_with_unnormalised_rows() -> None:
    # top_k zeroes tokens before top_p: the limit is top_p of what is left
    probs = randn(48, 300, seed=12, scale=2.0).softmax(-1)
    probs[:, ::3] = 0.0
    gen = torch.Generator().manual_seed(13)
    score = probs / torch.empty_like(probs).exponential_(generator=gen)
    top_p = torch.rand(48, generator=gen) * 0.98 + 0.01
    race = sampler_mod._nucleus_race(score, probs, top_p).tolist()
    sorted_ = sampler_mod._nucleus_sorted(score, probs, top_p * probs.sum(dim=-1)).tolist()
    assert race == sorted_


def test_nucleus_sort_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    probs = randn(32, 200, seed=10, scale=0.3).softmax(-1)  # flat: the race needs rounds
    gen = torch.Generator().manual_seed(11)
    score = probs / torch.empty_like(probs).exponential_(generator=gen)
    top_p = torch.full((32,), 0.5)
    expected = sampler_mod._nucleus_race(score, probs, top_p).tolist()
    monkeypatch.setattr(sampler_mod, "_NUCLEUS_ROUNDS", 1)
    assert sampler_mod._nucleus_race(score, probs, top_p).tolist() == expected


# --- penalties ------------------------------------------------------------------------------


def reference_penalties(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """vLLM / OpenAI penalties, one row, the obvious way."""
    out = logits.clone()
    p = r.params
    for t in set(r.prompt_ids) | set(r.output_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(r.output_ids):
        count = list(r.output_ids).count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def penalty_rows() -> list[SamplingRow]:
    gen = torch.Generator().manual_seed(12)

    def ids(n: int) -> list[int]:
        return torch.randint(0, V, (n,), generator=gen).tolist()

    return [
        row(SamplingParams(repetition_penalty=1.3), output=ids(20), prompt=ids(15)),
        row(SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5), output=ids(40)),
        row(SamplingParams(), output=ids(10), prompt=ids(10)),  # no penalties
        row(
            SamplingParams(repetition_penalty=0.7, presence_penalty=-1.0, frequency_penalty=2.0),
            output=ids(64),
            prompt=ids(30),
            blocked=(1, 2),
        ),
        row(SamplingParams(frequency_penalty=1.0), output=[], prompt=ids(5)),
    ]


def test_penalties_match_the_reference() -> None:
    rows = penalty_rows()
    logits = randn(len(rows), V, seed=13)
    work = Sampler(V)._processed(logits, rows)
    for i, r in enumerate(rows):
        expected = reference_penalties(logits[i], r)
        expected[list(r.blocked_ids)] = float("-inf")
        torch.testing.assert_close(work[i], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(logits, randn(len(rows), V, seed=13)), "the input logits were modified"


def test_greedy_picks_the_argmax_of_the_penalized_logits() -> None:
    rows = [
        SamplingRow(
            replace(r.params, temperature=0.0),
            0,
            r.output_ids,
            r.prompt_ids,
            (),
        )
        for r in penalty_rows()
    ]
    logits = randn(len(rows), V, seed=14)
    tokens = Sampler(V)(logits, rows).token_ids
    assert tokens == [int(reference_penalties(logits[i], r).argmax()) for i, r in enumerate(rows)]


def test_penalty_ids_out_of_range_are_an_error() -> None:
    bad = row(SamplingParams(presence_penalty=1.0), output=[V])
    with pytest.raises(ValueError, match="out of range"):
        Sampler(V)(randn(1, V), [bad])


# --- seeded sampling -----------------------------------------------------------------------


SEEDED = [
    SamplingParams(seed=7),
    SamplingParams(seed=7, temperature=0.6, top_p=0.9),
    SamplingParams(seed=123456789, top_k=20, min_p=0.05),
    SamplingParams(seed=2**63 - 1, temperature=1.3, presence_penalty=0.5),
]


@pytest.mark.parametrize("params", SEEDED, ids=["plain", "top_p", "top_k+min_p", "penalty"])
def test_seeded_rows_are_batch_invariant(params: SamplingParams) -> None:
    target = randn(1, V, seed=15, scale=1.0)
    for position in (0, 1, 57, 10_000):
        subject = row(params, position, output=[1, 2, 2])
        alone = Sampler(V, seed=1)(target, [subject]).token_ids[0]
        for batch, at in ((5, 3), (17, 0), (17, 16), (2, 1)):
            logits = randn(batch, V, seed=batch + at)
            logits[at] = target[0]
            others = [
                row(SamplingParams(seed=k, top_p=0.5) if k % 3 else SamplingParams(), k)
                for k in range(batch)
            ]
            others[0] = row(GREEDY)
            others[at] = subject
            # A different sampler (another engine, a re-prefill) gives the same token.
            got = Sampler(V, seed=batch)(logits, others).token_ids[at]
            assert got == alone, (position, batch, at)


def test_seeded_tokens_depend_on_seed_and_position() -> None:
    logits = randn(1, V, seed=16, scale=0.2)  # nearly uniform
    by_position = {
        Sampler(V)(logits, [row(SamplingParams(seed=1), p)]).token_ids[0] for p in range(40)
    }
    by_seed = {Sampler(V)(logits, [row(SamplingParams(seed=s), 5)]).token_ids[0] for s in range(40)}
    assert len(by_position) > 10 and len(by_seed) > 10


def test_row_key_mixes_seed_and_position() -> None:
    keys = {row_key(s, p) & 0xFFFFFFFF for s in range(64) for p in range(64)}
    assert len(keys) == 64 * 64  # distinct even in the low 32 bits torch's CPU generator uses


def test_seeded_distribution_matches_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    probs = (logits / 0.9).softmax(-1)
    # One request, many positions: how a seeded request actually walks its generator keys.
    n = 6000
    rows = [row(SamplingParams(seed=42, temperature=0.9), position=p) for p in range(n)]
    tokens = Sampler(6)(logits.expand(n, -1), rows).token_ids
    assert chi_square(tokens, probs) < 20.5  # chi-square, df = 5, p = 0.001


def test_unseeded_distribution_matches_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 6000
    tokens = Sampler(6, seed=3)(logits.expand(n, -1), [row(SamplingParams())] * n).token_ids
    assert chi_square(tokens, logits.softmax(-1)) < 20.5


# --- logprobs and shapes -------------------------------------------------------------------


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = randn(4, V, seed=17)
    rows = [
        row(
            SamplingParams(seed=1, logprobs=5, temperature=0.5, repetition_penalty=1.5),
            output=[3, 4],
        ),
        row(SamplingParams(logprobs=0, temperature=0.0)),
        row(SamplingParams(seed=2)),  # no logprobs asked
        row(SamplingParams(seed=3, logprobs=20, top_k=3), blocked=(0,)),
    ]
    out = Sampler(V)(logits, rows)
    raw = logits.log_softmax(-1)
    assert out.logprobs[2] is None
    for i, k in ((0, 5), (1, 0), (3, 20)):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(raw[i, lp.token_id]), abs=1e-5)
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        expected = raw[i].topk(k)
        assert [t for t, _ in lp.top] == expected.indices.tolist()
        assert values == pytest.approx(expected.values.tolist(), abs=1e-5)


def test_logprobs_bounded_by_the_vocabulary() -> None:
    out = Sampler(4)(randn(1, 4), [row(SamplingParams(logprobs=20, seed=0))])
    lp = out.logprobs[0]
    assert lp is not None and len(lp.top) == 4


def test_padded_vocab_columns_are_never_sampled() -> None:
    logits = randn(3, V + 16, seed=18)
    logits[:, V:] = 100.0  # lm_head padding past the real vocabulary
    rows = [row(GREEDY), row(SamplingParams(seed=1)), row(SamplingParams(seed=2, logprobs=3))]
    out = Sampler(V)(logits, rows)
    assert all(t < V for t in out.token_ids)
    assert out.token_ids[0] == logits[0, :V].argmax()


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError):
        Sampler(V)(randn(2, V), [row(GREEDY)])
    with pytest.raises(ValueError):
        Sampler(V)(randn(1, V - 1), [row(GREEDY)])
    assert Sampler(V)(torch.empty(0, V), []) == ([], [])


def test_input_logits_are_not_modified() -> None:
    logits = randn(4, V, seed=19)
    before = logits.clone()
    rows = [
        row(SamplingParams(seed=s, top_k=4, top_p=0.5, min_p=0.1), blocked=(1,)) for s in range(4)
    ]
    Sampler(V)(logits, rows)
    assert torch.equal(logits, before)


def test_deferred_sampling_adds_logit_bias_on_the_device_as_call_does() -> None:
    """A biased row is deferrable (its ids and values go to the device without a sync): the
    deferred path's tokens are __call__'s, for greedy and seeded sampled rows alike."""
    logits = randn(4, V, seed=9)
    params = [SamplingParams(temperature=0.0, logit_bias={3: 100.0}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.9, seed=4, logit_bias={int(logits[2].argmax()): -100.0, 5: 2.5}),
              SamplingParams(temperature=1.0, top_k=8, seed=1, logit_bias={9: 40.0})]  # fmt: skip
    rows = [row(p) for p in params]
    assert all(sampler_mod.deferrable(r) for r in rows)
    deferred = Sampler(V, seed=2).sample_tokens(logits.clone(), rows).tolist()
    assert deferred == Sampler(V, seed=2)(logits.clone(), rows).token_ids
    assert deferred[0] == 3 and deferred[2] != int(logits[2].argmax()) and deferred[3] == 9
