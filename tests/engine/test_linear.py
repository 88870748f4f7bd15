"""engine.linear: which matmul the model runs, and that oneDNN's agrees with F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import linear

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


def test_cpu_float32_takes_onednn_where_torch_has_it() -> None:
    if not linear._onednn_agrees():
        pytest.skip("this torch build has no working oneDNN linear")
    assert linear.select_linear(CPU, torch.float32) is linear.onednn_linear


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_matches_f_linear_on_model_shapes(rows: int, with_bias: bool) -> None:
    if not linear._onednn_agrees():
        pytest.skip("this torch build has no working oneDNN linear")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(1024, 256, generator=gen) * 0.05
    b = torch.randn(1024, generator=gen) if with_bias else None
    x = torch.randn(rows, 512, generator=gen)[:, ::2]  # a strided view, as a split or chunk gives
    with torch.inference_mode():
        got = linear.onednn_linear(x, w, b)
        packed = linear.onednn_linear(x, linear.prepare(linear.onednn_linear, w), b)  # as the model holds it
    assert got.shape == packed.shape == (rows, 1024)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_only_the_onednn_linear_gets_a_packed_weight() -> None:
    w = torch.randn(8, 4)
    assert linear.prepare(linear.torch_linear, w) is w
    if linear._onednn_agrees():
        packed = linear.prepare(linear.onednn_linear, w)
        assert packed.layout == torch._mkldnn and packed.shape == w.shape  # type: ignore[attr-defined]


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CPU_LINEAR", "torch")
    assert linear.select_linear(CPU, torch.float32) is linear.torch_linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_keep_f_linear(dtype: torch.dtype) -> None:
    assert linear.select_linear(CPU, dtype) is linear.torch_linear


def test_a_build_without_it_falls_back_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "_onednn_agrees", lambda: False)
    assert linear.select_linear(CPU, torch.float32) is linear.torch_linear
    monkeypatch.setenv("BATON_CPU_LINEAR", "onednn")
    with pytest.raises(RuntimeError, match="no working oneDNN linear"):
        linear.select_linear(CPU, torch.float32)


def test_a_bad_switch_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="BATON_CPU_LINEAR"):
        linear.select_linear(CPU, torch.float32)
