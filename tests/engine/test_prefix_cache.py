"""The prefix cache in the engine: identical greedy tokens with the cache on and off, real hits
(asserted through counters and num_cached_tokens), tenant isolation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.sampling import SamplingParams
from kvcache.hashing import cache_salt, page_hashes, tenant_of

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(model_dir: Path, cache: bool, **kw: int | str) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", enable_prefix_cache=cache, **kw))


def _run(engine: Engine, prompts: list[list[int]], salts: list[str] | None = None) -> tuple[list[list[int]], list[int]]:
    """Run prompts one after another; (tokens, cached tokens) per prompt."""
    tokens, cached = [], []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, GREEDY, cache_salt=salts[i] if salts else "")
        out: list[int] = []
        hit = -1
        while engine.has_unfinished():
            for step in engine.step():
                out.extend(step.token_ids)
                hit = step.num_cached_tokens
            engine.check_integrity()
        tokens.append(out)
        cached.append(hit)
    return tokens, cached


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    system = rng.integers(4, 16_384, size=100).tolist()  # 6 full pages + 4 tokens
    questions = [rng.integers(4, 16_384, size=n).tolist() for n in (5, 12, 28, 44)]
    shared = [system + q for q in questions]
    exact_pages = system[:96]  # a prompt that is all full pages: the last page is recomputed
    return [*shared, exact_pages, exact_pages, system]


def test_shared_prefixes_hit_and_change_nothing(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    off, off_hits = _run(_engine(tiny_model_dir, cache=False), prompts)
    on_engine = _engine(tiny_model_dir, cache=True)
    on, on_hits = _run(on_engine, prompts)
    assert on == off
    assert off_hits == [0] * len(prompts)
    # First request misses; the others reuse the 6 full pages of the shared system prompt
    # (96 tokens). The all-pages prompt hits 5 pages: its last page is always recomputed.
    assert on_hits == [0, 96, 96, 96, 80, 80, 96]
    stats = on_engine.prefix_cache.stats  # type: ignore[union-attr]
    assert stats.hit_tokens == sum(on_hits) and stats.query_tokens == sum(len(p) for p in prompts)


def test_multiturn_history_including_outputs_is_reused(tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(9)
    engine_on, engine_off = _engine(tiny_model_dir, True), _engine(tiny_model_dir, False)
    history_on: list[int] = []
    history_off: list[int] = []
    for turn in range(4):
        message = rng.integers(4, 16_384, size=23).tolist()
        (out_on,), (hit,) = _run(engine_on, [history_on + message])
        (out_off,), _ = _run(engine_off, [history_off + message])
        assert out_on == out_off
        if turn:
            # everything but the partial last page of the previous turn's prompt + output
            assert hit == (len(history_on) // 16) * 16 and hit > 0
        history_on += message + out_on
        history_off += message + out_off


def test_tenants_never_share_pages(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    engine = _engine(tiny_model_dir, cache=True)
    prompt = prompts[0]
    _, hits = _run(engine, [prompt, prompt, prompt, prompt], salts=["acme", "globex", "acme", "globex"])
    assert hits == [0, 0, 96, 96]  # each tenant hits only its own pages


def test_eviction_under_pressure_keeps_outputs_exact(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    off, _ = _run(_engine(tiny_model_dir, cache=False), prompts)
    small = _engine(tiny_model_dir, cache=True, num_pages=12)  # fits one request and a little cache
    on, hits = _run(small, prompts)
    assert on == off
    assert small.prefix_cache is not None and small.prefix_cache.stats.evicted_pages > 0
    assert any(hits[1:])


def test_purge_forgets_one_tenant_only(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    engine = _engine(tiny_model_dir, cache=True)
    _run(engine, [prompts[0], prompts[0]], salts=["acme", "globex"])
    assert engine.purge_tenant("acme") == 7  # 105 prompt + 11 computed output tokens = 7 full pages
    engine.check_integrity()
    _, hits = _run(engine, [prompts[0], prompts[0]], salts=["acme", "globex"])
    assert hits == [0, 96]


def test_a_request_salt_narrows_reuse_within_a_tenant_and_purges_with_it(
    tiny_model_dir: Path, prompts: list[list[int]]
) -> None:
    engine = _engine(tiny_model_dir, cache=True)
    acme, acme_x, acme_y = "acme", cache_salt("acme", "x"), cache_salt("acme", "y")
    assert tenant_of(acme_x) == "acme" and acme_x != acme_y
    _, hits = _run(engine, [prompts[0]] * 5, salts=[acme, acme_x, acme_y, acme_x, acme])
    assert hits == [0, 0, 0, 96, 96]  # only the same tenant *and* salt share pages
    # Purging the tenant forgets its salted pages too: 3 salts x 7 full pages.
    assert engine.purge_tenant("acme") == 21
    engine.check_integrity()


def test_concurrent_requests_wait_for_a_prefix_being_computed(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    engine = _engine(tiny_model_dir, cache=True)
    system = prompts[-1]  # 100 tokens: 6 full pages
    for i, q in enumerate(([7, 8, 9], [10, 11], [12])):
        engine.add_request(f"c{i}", system + q, GREEDY)
    # Only c2 runs (the least uncached work goes first): c0 and c1 would recompute the pages
    # c2 is computing, so they wait for them.
    first = engine.step()
    assert [o.req_id for o in first] == ["c2"]
    hits: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            hits[out.req_id] = out.num_cached_tokens
    assert hits == {"c2": 0, "c0": 96, "c1": 96}


def test_an_operator_shared_prefix_is_shared_across_tenants(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    system = prompts[-1]  # 100 tokens: 6 full pages
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", shared_prefixes=(tuple(system[:64]),)))
    a, b = system + [5, 6, 7], system + [5, 6, 7]
    _, hits = _run(engine, [a, b, b], salts=["acme", "globex", "globex"])
    # globex reuses the 4 public pages acme computed, but not acme's 2 private ones after them;
    # its second request then hits its own pages too.
    assert hits == [0, 64, 96]
    off, _ = _run(_engine(tiny_model_dir, cache=False), [a])
    on, _ = _run(engine, [a], salts=["initech"])
    assert on == off


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_concurrent_rows_of_one_cached_prefix_decode_in_cascade_with_the_same_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Decode rows that share cached pages attend in cascade (engine.attention's torch path;
    the cpu kernel reads the shared pages once for all of them); their greedy tokens are the
    ones each prompt gets alone with no cache."""
    import engine.attention as attention
    import engine.cpu_kernels as cpu_kernels

    rng = np.random.default_rng(11)
    system = rng.integers(4, 16_384, size=150).tolist()  # 9 full pages + 6 tokens
    prompts = [system + rng.integers(4, 16_384, size=n).tolist() for n in (3, 9, 17, 30)]
    alone, _ = _run(_engine(tiny_model_dir, cache=False, attention_backend="torch"), prompts)

    cascades: list[int] = []
    real, real_plan = attention._decode_cascade, cpu_kernels.DecodePlan.build

    def counted(*args: object, **kwargs: object) -> object:
        cascades.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    def planned(*args: object, **kwargs: object) -> object:
        plan = real_plan(*args, **kwargs)  # type: ignore[arg-type]
        cascades.extend([1] if plan.num_shared_pages else [])
        return plan

    monkeypatch.setattr(attention, "_decode_cascade", counted)
    monkeypatch.setattr(cpu_kernels.DecodePlan, "build", planned)
    engine = _engine(tiny_model_dir, cache=True, attention_backend=backend)
    _run(engine, [system + [5]])  # caches the system prompt's full pages
    for i, prompt in enumerate(prompts):
        engine.add_request(f"c{i}", prompt, GREEDY)
    together: dict[str, list[int]] = {f"c{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for step in engine.step():
            together[step.req_id].extend(step.token_ids)
        engine.check_integrity()
    assert [together[f"c{i}"] for i in range(len(prompts))] == alone
    assert cascades, "no decode step attended in cascade"


def test_a_sessions_pages_are_marked_in_the_cache(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    """A session's request (Job.session) computes pages the cache keeps after its tenant's
    others (kvcache.radix); the same prompt outside a session leaves them unmarked."""
    engine = _engine(tiny_model_dir, cache=True)
    cache = engine.prefix_cache
    assert cache is not None
    for req_id, prompt, session in (("s", prompts[0], "acme\x1fconv"), ("p", prompts[1], "")):
        engine.add(Job(req_id, tuple(prompt), GREEDY, cache_salt="acme", session=session))
        while engine.has_unfinished():
            engine.step()
    marked = {n.hash: n.session for n in cache._nodes.values()}
    system = page_hashes(prompts[0][:96], 16, b"acme", engine.fingerprint)  # the 6 pages both prompts share
    assert all(marked[h] for h in system)  # computed in the session (reused outside it: still marked)
    tail = page_hashes(prompts[1][:112], 16, b"acme", engine.fingerprint)[6:]  # the plain request's own page
    assert tail and not any(marked[h] for h in tail)
    engine.check_integrity()
