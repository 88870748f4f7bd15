"""engine.kernel_info: what an engine runs on, as /status and /metrics report it -- including a
CPU engine whose compiled kernels could not be built, which serves on the torch path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import cpu_kernels, linear
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.kernel_info import EngineKernels, kernels_of
from engine.sampling import SamplingParams
from tests.engine.native_isa import native_isa


def _engine(model: Path, **kw: object) -> Engine:
    return Engine(EngineConfig(model=str(model), max_model_len=256, num_pages=32, **kw))  # type: ignore[arg-type]


def test_a_cpu_engine_reports_baton_kernels(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    assert engine.kernels == EngineKernels("cpu", "panel", "fused", native_isa(), "float32", "cpu")
    assert kernels_of(engine) == engine.kernels  # read once at build; nothing changes it afterwards
    bf16 = _engine(tiny_model_dir, kv_cache_dtype="bfloat16")
    assert bf16.kernels == EngineKernels("cpu", "panel", "fused", native_isa(), "bfloat16", "cpu")


def test_forced_torch_projections_show(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CPU_LINEAR", "torch")
    kernels = _engine(tiny_model_dir).kernels
    # F.linear's projections: the one-call decode step (panels only) is off, attention is still baton's
    assert (kernels.attention, kernels.linear, kernels.decode_step) == ("cpu", "torch", "per-layer")


@pytest.fixture
def no_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A machine without a C compiler: nothing built yet (a fresh cache), none on PATH."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "_kernels", {})
    linear._panels_agree.cache_clear()
    yield
    linear._panels_agree.cache_clear()  # the kernels of the session's cache again, for the tests after


def test_without_a_compiler_the_engine_serves_on_torch_and_says_so(
    tiny_model_dir: Path, no_compiler: None, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _engine(tiny_model_dir)
    assert "CPU kernels (torch.float32 KV) unavailable" in caplog.text
    kernels = engine.kernels
    assert kernels.attention == "torch" and kernels.decode_step == "per-layer" and kernels.isa == ""
    assert kernels.linear in ("onednn", "torch")  # oneDNN's where this torch has it
    (out,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out) == 4
