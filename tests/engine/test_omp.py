"""One OpenMP pool, the step thread's: a thread that built or warmed an engine lets its workers go.

libgomp names a pool's workers as their creating thread (Linux threads inherit the name), so
a thread given a name of its own can count exactly its workers in /proc/self/task.
libgomp's pause joins the workers before it returns: the counts below are not a race."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.job import Job
from engine.omp import gnu_openmp, release_thread_pool
from engine.sampling import SamplingParams

PR_SET_NAME = 15


pytestmark = [
    pytest.mark.skipif(not gnu_openmp(), reason="torch's OpenMP runtime here is not libgomp"),
    pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: no OpenMP workers to count"),
]


def _name_this_thread(name: str) -> None:
    ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode(), 0, 0, 0)


def _tasks_named(name: str) -> set[int]:
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as comm:
                if comm.read().strip() == name:
                    found.add(int(tid))
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return found


def _on_named_thread(name: str, fn: Callable[[], object]) -> object:
    """Run fn on a fresh thread called `name` (its OpenMP workers get that name too)."""
    box: dict[str, object] = {}

    def run() -> None:
        _name_this_thread(name)
        try:
            box["result"] = fn()
        except BaseException as exc:  # re-raised on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]


def _parallel_op() -> None:
    torch.ones(1 << 22).add_(1.0)  # ATen splits this over the pool's threads


def test_a_released_thread_pool_lets_its_workers_go() -> None:
    def probe() -> tuple[int, bool, int]:
        me = threading.get_native_id()
        _parallel_op()
        workers = _tasks_named("baton-omp-a") - {me}
        released = release_thread_pool()
        left = _tasks_named("baton-omp-a") - {me}
        return len(workers), released, len(left)

    workers, released, left = _on_named_thread("baton-omp-a", probe)
    assert workers == torch.get_num_threads() - 1  # the pool existed: the check can fail
    assert released and left == 0


def test_starting_the_step_thread_releases_the_pool_of_the_thread_that_built_the_engine(tiny_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def build_warm_and_serve() -> tuple[set[int], set[int], list[int], list[int]]:
        engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=256))
        expected = engine.generate([list(range(30, 90))], params)[0]  # warmed here: this thread has a pool
        builders_workers = _tasks_named("baton-omp-b") - {threading.get_native_id()}

        async def serve() -> tuple[set[int], list[int]]:
            front = AsyncEngine(engine)
            front.start()  # the step thread is named baton-omp-b too, and has no pool yet
            left = builders_workers & _tasks_named("baton-omp-b")
            try:
                got: list[int] = []
                async for out in front.generate(Job("r", tuple(range(30, 90)), params)):
                    got.extend(out.token_ids)
            finally:
                await front.stop()
            return left, got

        left, got = asyncio.run(serve())
        return builders_workers, left, expected, got

    builders_workers, left, expected, got = _on_named_thread("baton-omp-b", build_warm_and_serve)  # type: ignore[misc]
    assert len(builders_workers) == torch.get_num_threads() - 1
    assert left == set()
    assert got == expected


def test_an_idle_step_thread_lets_its_workers_go_and_makes_a_new_pool_for_the_next_request(tiny_model_dir: Path) -> None:
    """An idle engine's pool would keep every other torch thread of the process from spinning
    (the suite's shared server made the parity tests 1.9x slower): once idle for a whole idle
    wait, the step thread releases it, and its next torch work starts a new one. The workers are
    counted on the step thread right after it ran the model (an AsyncEngine.call), so no idle
    wait can end between the work and the count."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = tuple(range(30, 90))

    def serve() -> tuple[list[int], int, int, int, list[int]]:
        engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=256))

        async def run() -> tuple[list[int], int, int, int, list[int]]:
            await asyncio.to_thread(lambda: None)  # the executor's thread, named baton-omp-c too
            others = _tasks_named("baton-omp-c")  # this thread and the executor's: not counted

            def step_thread_and_workers(e: Engine) -> int:  # on the step thread, after a forward pass
                e.generate([list(prompt)], params)
                return len(_tasks_named("baton-omp-c") - others)

            async def tokens(req_id: str) -> list[int]:
                got: list[int] = []
                async for out in front.generate(Job(req_id, prompt, params)):
                    got.extend(out.token_ids)
                return got

            front = AsyncEngine(engine, idle_wait_s=0.05)
            front.start()  # the step thread is named baton-omp-c too: it and its workers are counted
            try:
                first = await tokens("a")
                busy = await front.call(step_thread_and_workers)
                front.pool_released.clear()  # set again only by a release after that call
                assert await asyncio.to_thread(front.pool_released.wait, 30)
                idle = len(_tasks_named("baton-omp-c") - others)  # the step thread alone
                second = await tokens("b")  # stepping on a released pool
                again = await front.call(step_thread_and_workers)
            finally:
                await front.stop()
            return first, busy, idle, again, second

        return asyncio.run(run())

    first, busy, idle, again, second = _on_named_thread("baton-omp-c", serve)  # type: ignore[misc]
    assert busy == torch.get_num_threads()  # the step thread and its pool's workers: the check can fail
    assert idle == 1
    assert again == busy  # the step thread's torch work made a new pool
    assert first == second
