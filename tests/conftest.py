"""Shared fixtures (a private model cache, baton-tiny) and the suite time budgets.

Each suite (tests/<suite>/) has a time budget.

Budgets live in pyproject.toml under [tool.baton.test-budgets]. The summary prints each
suite's total time; a suite over its budget fails the session, so CI's 20-minute bound
cannot erode one slow test at a time. (This is a budget on the suite, not a performance
claim: speed is measured by the benchmarks.)
"""

from __future__ import annotations

import os
import shutil
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.builtin import resolve_model_dir
from engine.omp import release_thread_pool
from tests.etcd_server import INSTALL_HINT, EtcdServer

ROOT = Path(__file__).resolve().parents[1]

# transformers is only the parity reference here: it must never reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# engine.faults: the fault suite arms failures in engines, in this process and in Ray actors
# (cluster.fleet.ray_runtime passes it on to them); production processes never have it.
os.environ["BATON_FAULT_INJECTION"] = "1"


@pytest.fixture(scope="session", autouse=True)
def baton_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point BATON_CACHE_DIR at a fresh directory, so tests neither read nor fill the
    developer's cache."""
    path = tmp_path_factory.mktemp("baton-cache")
    previous = os.environ.get("BATON_CACHE_DIR")
    os.environ["BATON_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("BATON_CACHE_DIR", None)
    else:
        os.environ["BATON_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def tiny_model_dir(baton_cache_dir: Path) -> Path:
    """baton-tiny, created once per session in the test cache (the built-in path)."""
    path = resolve_model_dir("baton-tiny")
    assert path.is_relative_to(baton_cache_dir)
    return path

_durations: dict[str, float] = defaultdict(float)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd on loopback for the whole run (membership, security and Ray deployment
    tests): a failure, not a skip, without the binary, as these tests must run in CI."""
    if shutil.which("etcd") is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    server = EtcdServer.launch(tmp_path_factory.mktemp("etcd"))
    yield server
    server.stop()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Each test starts with no OpenMP pool on the test runner's thread: one left by an earlier
    test's torch work would keep the step threads of the servers this test starts from spinning
    their own pools (engine.omp); a test that runs torch here makes a new one."""
    release_thread_pool()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """tests/faults runs right after tests/cluster: they share one local Ray, started once."""
    def rank(item: pytest.Item) -> int:
        return 1 if _suite(item.nodeid) == "faults" else 0

    cluster_end = max((i for i, item in enumerate(items) if _suite(item.nodeid) == "cluster"), default=-1)
    if cluster_end < 0:
        return
    head, tail = items[: cluster_end + 1], items[cluster_end + 1 :]
    items[:] = head + sorted(tail, key=lambda item: -rank(item))  # stable: faults first, the rest as they were


def _budgets() -> dict[str, float]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {k: float(v) for k, v in data["tool"]["baton"]["test-budgets"].items()}


def _suite(nodeid: str) -> str:
    parts = nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[_suite(report.nodeid)] += report.duration


def _over_budget() -> list[tuple[str, float, float]]:
    budgets = _budgets()
    return [(s, t, budgets[s]) for s, t in sorted(_durations.items()) if s in budgets and t > budgets[s]]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _durations:
        return
    budgets = _budgets()
    terminalreporter.section("suite time budgets")
    for suite, total in sorted(_durations.items()):
        budget = budgets.get(suite)
        mark = "" if budget is None or total <= budget else "  OVER BUDGET"
        limit = f"{budget:.0f} s" if budget is not None else "no budget"
        terminalreporter.write_line(f"{suite:<10} {total:7.1f} s of {limit}{mark}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == 0 and _over_budget():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
