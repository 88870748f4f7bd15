"""bench/gpu_check.py's CPU dry run (`--cpu`): the device check runs the same stages on small
shapes, from the source tree as on the device machine (PYTHONPATH=., nothing installed), so a
change that breaks a stage is found here and not in a lent device's 15 minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("env", "parity", "decode", "graphs", "kernels", "nccl", "host", "prefill")


def test_cpu_dry_run_finishes_every_stage_and_writes_its_report(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BATON_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), str(tmp_path / "out"), "--cpu"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    failed = {name: report[name].get("error") for name in STAGES if not report.get(name, {}).get("ok")}
    assert not failed, failed
    assert report["parity"]["pass"] is True
    for model in ("baton-tiny", "one-b"):
        assert report["parity"][model]["mismatched_sequences"] == 0
        assert report["parity"][model]["pages_back_at_idle"] is True
    decode = report["decode"]
    assert decode["weight_bytes"] > 0 and decode["kv_bytes_per_token"] > 0
    for batch in (1, 4):
        assert decode[f"batch_{batch}"]["engine_tok_s"] > 0
    assert report["kernels"]["sum_of_kernels_per_step_ms"] > 0
    assert report["nccl"]["ok"] and report["host"]["ok"]
