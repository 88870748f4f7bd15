"""Graceful drain on a real local Ray (issue 7, acceptance item 3): SIGTERM to a worker actor's
process under steady load drains it -- it leaves membership (not-ready), gets no new work after
that, finishes what it has, and exits through Ray as an intended exit -- with 0 failed client
requests. The planner's path (add_worker, drain_worker) is the same drain, called by the gateway."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import pytest

from cluster import cli
from cluster.disagg_config import DisaggConfig, MembershipConfig
from cluster.edge.http_api import HttpConfig
from cluster.fleet.front import RayFront
from cluster.fleet.scalers import pod_of_worker, scaler_for
from cluster.ops.planner_k8s import KubeRayScaler
from cluster.ops.planner_loop import LocalRayScaler
from cluster.server import ServerConfig
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.sampling import SamplingParams
from tests.cluster.conftest import ServerHandle, start_server
from tests.cluster.test_planner import FakeCustomObjects, groups, raycluster, validate_raycluster
from tests.cluster.test_ray_serving import metric

ray = pytest.importorskip("ray")

T = TypeVar("T")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def pd3(ray_cluster: Any, tiny_engine_config: EngineConfig) -> Iterator[ServerHandle]:
    cfg = ServerConfig(engine=tiny_engine_config, grpc_port=None, served_model_name="baton-tiny",
                       http=HttpConfig(port=0, enable_admin=True),
                       disagg=DisaggConfig(num_prefill=1, num_decode=2, transport="grpc",
                                           membership=MembershipConfig(lease_ttl_s=3)))  # fmt: skip
    handle = start_server(cfg, None)
    yield handle
    handle.stop()


def on_loop(handle: ServerHandle, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
    return asyncio.run_coroutine_threadsafe(coro, handle.loop).result(timeout_s)


class Load:
    """`streams` request loops through the gateway, each bounded, until stopped; records every
    outcome and the decode worker each request was placed on (and when)."""

    def __init__(self, handle: ServerHandle, streams: int = 3, max_requests: int = 400) -> None:
        self.handle, self.front = handle, handle.running.front
        assert isinstance(self.front, RayFront)
        self.ok = 0
        self.failed: list[str] = []
        self.placed: list[tuple[float, str | None, str | None]] = []  # (time, decode, prefill)
        self.stop = threading.Event()
        self.streams, self.max_requests = streams, max_requests
        front = self.front
        real = front._placement

        async def recording(job: Any) -> Any:
            p = await real(job)
            self.placed.append((time.monotonic(), p.decode_id, p.prefill_id))
            return p

        front._placement = recording  # type: ignore[method-assign]
        self._real = real
        self.future = asyncio.run_coroutine_threadsafe(self._run(), handle.loop)

    async def _one(self, stream: int, rng: random.Random) -> None:
        for i in range(self.max_requests):
            if self.stop.is_set():
                return
            n = rng.choice((24, 120))  # short: decode-local; long: a prefill worker computes it
            prompt = [rng.randrange(100, 1000) for _ in range(n)]
            try:
                tokens = 0
                async for out in self.front.generate(Job(f"load-{stream}-{i}", tuple(prompt), GREEDY)):
                    tokens += len(out.token_ids)
                assert tokens == GREEDY.max_tokens, tokens
                self.ok += 1
            except Exception as exc:
                self.failed.append(repr(exc))

    async def _run(self) -> None:
        await asyncio.gather(*(self._one(s, random.Random(s)) for s in range(self.streams)))

    def finish(self) -> None:
        self.stop.set()
        self.future.result(120)
        self.front._placement = self._real  # type: ignore[method-assign]


def wait_for(check: Any, what: str | Callable[[], str], timeout_s: float = 20.0) -> None:
    """Until check(); else fail with `what` (a callable: the message as things are at the end)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.02)


def exit_kind(actor: Any) -> str:
    """How Ray says the actor ended (its RayActorError's text), once it has."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=30)
        except ray.exceptions.RayActorError as exc:
            return str(exc)
        time.sleep(0.1)
    raise AssertionError("the actor never exited")


def test_streams_move_when_their_decode_worker_is_killed(pd3: ServerHandle, server: ServerHandle) -> None:
    """SIGKILL a decode actor mid-stream: every stream on it moves (prompt + the tokens already
    emitted, to the other decode worker) and completes, token for token what a colocated
    engine writes at temperature 0 -- no gap, no repeat. Then a new decode worker is added."""
    import openai

    from tests.cluster.conftest import kill_actor

    front = pd3.running.front
    assert isinstance(front, RayFront)
    prompts = [f"# request {i}: " + "the quick brown fox jumps over the lazy dog " * (2 + i % 3) for i in range(6)]
    want = [openai.OpenAI(base_url=server.url + "/v1", api_key="x").completions.create(
        model="baton-tiny", prompt=p, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0].text for p in prompts]  # fmt: skip
    got: list[str] = [""] * len(prompts)
    errors: list[str] = []
    started = threading.Barrier(len(prompts) + 1, timeout=60)

    def stream(i: int) -> None:
        client = openai.OpenAI(base_url=pd3.url + "/v1", api_key="x", timeout=60, max_retries=0)
        try:
            chunks = iter(client.completions.create(model="baton-tiny", prompt=prompts[i], max_tokens=40,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True}))
            first = next(chunks)
            got[i] += first.choices[0].text
            started.wait()
            for chunk in chunks:
                got[i] += chunk.choices[0].text
        except Exception as exc:
            errors.append(repr(exc))
            started.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first token
    victim = max(front.fleet.decodes, key=lambda d: d.num_active)  # the decode worker with the most of them
    on_victim = victim.num_active
    kill_actor(victim.actor)
    for t in threads:
        t.join(90)
    assert errors == [], errors[:2]
    assert got == want
    assert on_victim > 0 and front.metrics.migrations._value.get() >= on_victim  # noqa: SLF001
    assert on_loop(pd3, front.fleet.add_worker("decode"), 180) == "decode-2"  # back to two decode workers


def test_sigterm_drains_a_decode_worker_under_load(pd3: ServerHandle) -> None:
    front = pd3.running.front
    assert isinstance(front, RayFront)
    victim = next(d for d in front.fleet.decodes if d.is_routable and d.name != "decode-2")  # one of the first two
    pid = ray.get(victim.actor.place_of.remote(), timeout=30).pid
    load = Load(pd3)
    try:
        wait_for(lambda: sum(d == victim.name for _, d, _ in load.placed) >= 3, f"no load reached {victim.name}")
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not victim.is_member, f"{victim.name} did not leave membership on SIGTERM")
        left_at = time.monotonic()
        wait_for(lambda: not victim.is_alive, f"{victim.name} did not exit after its drain", 60)
        served_after = load.ok
        wait_for(lambda: load.ok >= served_after + 6, "the load stopped after the drain")
    finally:
        load.finish()
    assert load.failed == [], load.failed[:3]
    late = [t for t, d, _ in load.placed if d == victim.name and t > left_at + 0.2]
    assert late == [], f"work was placed on {victim.name} after it reported not-ready"
    reason = exit_kind(victim.actor)
    print(reason)
    assert "INTENDED_USER_EXIT" in reason or "exit_actor" in reason, reason  # exit 0, not a crash
    wait_for(lambda: not _running(pid), "the drained worker's process is still running", 15)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_the_planners_add_and_drain_serve_every_request(pd3: ServerHandle) -> None:
    """The planner adds a prefill worker: it is routed to, gets the prefix pinned before it
    came (cluster.fleet.pins), serves, and drains away with nothing abandoned."""
    front = pd3.running.front
    assert isinstance(front, RayFront)
    prefix = [random.Random(7).randrange(100, 1000) for _ in range(40)]  # 2 whole pages
    pinned = httpx.post(pd3.url + "/admin/pins", json={"tenant": "acme", "pin_id": "sys", "token_ids": prefix,
                                                       "ttl_s": 600}, timeout=60)  # fmt: skip
    assert pinned.status_code == 200 and pinned.json()["workers"] == {"prefill-0": "held"}, pinned.text
    name = on_loop(pd3, front.fleet.add_worker("prefill"), 180)
    assert name == "prefill-1" and front.fleet.prefill_of[name].is_routable
    assert any(v.prefill == name and v.routable for v in front.pairs.views())  # the adopted worker is routed

    def pin_workers() -> dict[str, str]:
        [pin] = httpx.get(pd3.url + "/status", timeout=10).json()["pins"]
        return dict(pin["workers"])

    # "held" is the new worker's own answer: its engine holds the prefix's pages under the pin.
    wait_for(lambda: pin_workers() == {"prefill-0": "held", name: "held"}, "the added worker did not get the pin", 60)
    assert metric(pd3, "baton_pins_reapplied_total", role="prefill", outcome="held") == 1
    load = Load(pd3)
    try:
        wait_for(lambda: sum(p == name for _, _, p in load.placed) >= 2, "the new prefill worker got no work", 60)
        report = on_loop(pd3, front.fleet.drain_worker(name), 120)
        assert report.abandoned == 0
        assert name not in front.fleet.prefill_of and all(n.name != name for n in front.nodes())
        assert all(v.prefill != name for v in front.pairs.views())  # and its routes are gone
        served_after = load.ok
        wait_for(lambda: load.ok >= served_after + 6, "the load stopped after the drain")
    finally:
        load.finish()
        httpx.delete(pd3.url + "/admin/pins/acme/sys", timeout=30)
    assert load.failed == [], load.failed[:3]


def test_the_planner_adds_and_removes_actors_with_the_load(pd3: ServerHandle) -> None:
    """The planner on the real gateway: prompts queued at the prefill worker while first
    tokens come late -> it adds a prefill actor; the load stops -> it drains one away (the least
    valuable cache), back to the minimum. Every client request succeeds.

    The load is made, not hoped for: the prefill worker is stalled (a drill) while a wave of
    prompts queues there, so the wave's first tokens are late however fast the machine is; a
    second wave then queues the same way, and only then does the planner take a sample -- it
    sees the first wave's late first tokens and the second wave's prompts waiting. (Real load
    from client loops decided nothing on some machines: a ~300-token prefill is short on a fast
    one, and its queue was empty at most samples.)"""
    from dataclasses import replace

    from cluster.ops.planner import Limits, Planner, PlannerConfig
    from cluster.ops.planner_loop import LatencyWindow, LocalRayScaler, run, sample_from

    front, frontend = pd3.running.front, pd3.running.frontend
    assert isinstance(front, RayFront)
    before = {p.name for p in front.fleet.prefills if p.is_routable}
    prefill = front.fleet.prefills[0].actor
    cfg = PlannerConfig(ttft_slo_s=0.02, itl_slo_s=30.0, out_samples=1, in_samples=3, cooldown_s=0.5,
                        settle_timeout_s=120.0, prefill_queue_tokens=64, scale_in_frac=0.5,
                        limits=Limits(min_prefill=len(before), max_prefill=len(before) + 1, min_decode=1,
                                      max_decode=2, min_total=2, max_total=4))  # fmt: skip
    planner, window, stop = Planner(cfg), LatencyWindow(frontend.metrics), asyncio.Event()
    tickets, flowing, lock = [0], threading.Event(), threading.Lock()  # samples let through; all once flowing

    def take() -> bool:
        with lock:
            if tickets[0]:
                tickets[0] -= 1
                return True
        return flowing.is_set()

    async def sample() -> Any:
        while not take():  # the test's own state, not the load's: no sample is taken until it says
            await asyncio.sleep(0.05)
        taken = await sample_from(frontend, window)
        seen.append(f"(after: {planner.last_reason}) TTFT p90 {taken.ttft_p90_s}, ITL p90 {taken.itl_p90_s}, "
                    f"{[(n.name, n.health, n.pending_tokens) for n in taken.nodes]}")  # fmt: skip
        return taken

    seen: list[str] = []  # each sample as the planner got it, after what it said of the one before: a failure's message
    ok, failed = [0], []

    def wave(seed: int, n: int = 4) -> list[threading.Thread]:
        def one(i: int) -> None:
            rng = random.Random(seed * 100 + i)
            prompt = " ".join(str(rng.randrange(10**6)) for _ in range(100))  # ~300 tokens
            r = httpx.post(f"{pd3.url}/v1/completions", json={"model": "baton-tiny", "prompt": prompt,
                                                               "max_tokens": 2}, timeout=120)  # fmt: skip
            if r.status_code == 200:
                ok[0] += 1
            else:
                failed.append(r.status_code)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        return threads

    def queued(n: int) -> Callable[[], bool]:  # n prompts wait at the stalled prefill worker
        return lambda: ray.get(prefill.stats.remote(), timeout=30).num_running >= n

    def seen_queued() -> bool:  # as the planner's sample will read it (the stats the gateway last got)
        nodes = on_loop(pd3, frontend.nodes())
        return any(n.name == front.fleet.prefills[0].name and n.pending_tokens > 0 for n in nodes)

    def added() -> bool:
        return len({p.name for p in front.fleet.prefills if p.is_routable}) > len(before)

    def deciding_to_add() -> bool:
        pending = planner.pending
        return (pending is not None and pending.action == "add" and pending.role == "prefill") or added()

    placement = front.cfg  # every prompt to the prefill worker (the cost model would prefill some on decode)
    front.cfg = replace(placement, placement="round_robin")
    planning = asyncio.run_coroutine_threadsafe(
        run(planner, LocalRayScaler(front.fleet), sample, 0.2, stop, action_timeout_s=180.0, max_samples=2000,
            sample_timeout_s=60.0), pd3.loop)  # fmt: skip
    try:
        try:
            ray.get(prefill.stall.remote(600), timeout=30)  # the first wave queues, its first tokens late
            first = wave(1)
            wait_for(queued(len(first)), "the first wave did not queue at the prefill worker", 60)
            time.sleep(0.3)  # its first tokens at least this late: 15x the TTFT SLO
            ray.get(prefill.stall.remote(0), timeout=30)
            for t in first:
                t.join(120)
            ray.get(prefill.stall.remote(600), timeout=30)  # the second wave queues
            second = wave(2)
            wait_for(queued(len(second)), "the second wave did not queue at the prefill worker", 60)
            wait_for(seen_queued, "the gateway's view of the prefill worker never showed the second wave", 60)
            with lock:
                tickets[0] += 1  # one sample: the first wave's TTFTs, the second wave's queue
            wait_for(deciding_to_add, lambda: f"the planner decided to add no prefill worker ({planner.last_reason}); "
                                              f"it saw: {seen[-2:]}", 60)  # fmt: skip
        finally:
            flowing.set()
            ray.get(prefill.stall.remote(0), timeout=30)
            front.cfg = placement
        for t in second:
            t.join(120)
        assert failed == [] and ok[0] == len(first) + len(second)
        wait_for(added, lambda: f"the planner added no prefill worker; it saw: {seen[-8:]}", 120)
        wait_for(lambda: len({p.name for p in front.fleet.prefills if p.is_routable}) == len(before),
                 lambda: f"the planner did not scale back in ({planner.last_reason}); it saw: {seen[-8:]}", 120)  # fmt: skip
    finally:  # the planner stops with the test, also a failed one (the module's gateway goes on)
        pd3.loop.call_soon_threadsafe(stop.set)
    decisions = planning.result(30)
    assert [(d.action, d.role) for d in decisions] == [("add", "prefill"), ("remove", "prefill")], decisions


def test_on_kuberay_the_scaler_patches_the_group_and_starts_or_drains_the_actor(pd3: ServerHandle) -> None:
    """scaler_for() in a KubeRay head pod (its environment names the RayCluster): an add makes
    room in the worker group, then starts the actor on the real Ray; a remove drains the actor,
    then names its pod (its Ray node's host name) for deletion. The API server is a recording
    stand-in here (the real kubernetes client: tests/cluster/test_planner.py)."""
    front = pd3.running.front
    assert isinstance(front, RayFront)
    log: list[Any] = []
    api = FakeCustomObjects(raycluster(decode=2), log)
    scaler = scaler_for(front.fleet, ("baton", "baton"), api=api)
    assert isinstance(scaler, KubeRayScaler) and isinstance(scaler_for(front.fleet, None), LocalRayScaler)
    name = on_loop(pd3, scaler.add("decode"), 180)
    assert name in front.fleet.decode_of and front.fleet.decode_of[name].is_routable
    assert groups(api.obj)["decode"]["replicas"] == 3
    assert on_loop(pd3, pod_of_worker(front.fleet, name)) == socket.gethostname()  # one host: its pod
    with pytest.raises(KeyError):
        on_loop(pd3, pod_of_worker(front.fleet, "decode-99"))
    on_loop(pd3, scaler.remove("decode", name), 120)
    assert name not in front.fleet.decode_of  # drained and stopped before the pod was named
    after = groups(api.obj)["decode"]
    assert after["replicas"] == 2 and after["scaleStrategy"] == {"workersToDelete": [socket.gethostname()]}
    validate_raycluster(api.obj)
    assert [entry[0] for entry in log] == ["get", "patch", "get", "patch"]


def test_baton_scale_brings_a_pool_to_size_through_the_gateway(
    pd3: ServerHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    """`baton scale` -> POST /admin/scale -> the planner's scaler (here the gateway's own Ray
    actors): one more decode worker, then back, the one with the least work drained first."""
    front = pd3.running.front
    assert isinstance(front, RayFront)

    def decodes() -> list[str]:
        return [d.name for d in front.fleet.decodes if d.is_alive and d.is_member]

    start = decodes()
    assert cli.main(["scale", f"decode={len(start) + 1}", "--url", pd3.url]) == 0
    [new] = [n for n in decodes() if n not in start]
    assert capsys.readouterr().out.strip() == f"decode: {len(start)} -> {len(start) + 1}  (+{new})"
    assert cli.main(["scale", f"decode={len(start)}", "--url", pd3.url]) == 0
    assert len(decodes()) == len(start) and new not in front.fleet.decode_of  # idle: the newest went
    assert capsys.readouterr().out.strip() == f"decode: {len(start) + 1} -> {len(start)}  (-{new})"
    for bad in ({"decode": 0}, {"gpu": 1}, {}, {"prefill": "2"}, {"decode": 10_000}):
        reply = httpx.post(pd3.url + "/admin/scale", json=bad, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["message"], (bad, reply.text)
    assert cli.main(["scale", "decode=two", "--url", pd3.url]) == 2  # a clear one-line error
    assert "decode=M" in capsys.readouterr().err
    assert decodes() == start
