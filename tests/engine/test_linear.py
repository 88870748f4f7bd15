"""engine.linear: which matmul the model runs, and that baton's panel kernel and oneDNN's agree
with F.linear (the reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import linear
from tests.engine.native_isa import SUBPANEL_WIDTH, native_isa

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


def test_cpu_float32_takes_the_panel_kernel() -> None:
    assert linear._panels_agree()  # a C compiler is part of the set-up (README), as for attention
    assert linear.select_linear(CPU, torch.float32) is linear.panel_linear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 63, 64, 65, 130])
@pytest.mark.parametrize("out_features", [64, 200, 1024])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_panel_kernel_matches_f_linear(rows: int, out_features: int, with_bias: bool) -> None:
    """Every row count the kernel splits differently (1-5 rows alone, tiles of 4 or 6, of 64, a
    remainder), full panels and a narrow last one (200 = 3 x 64 + 8), bias or none."""
    gen = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, 96, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, 96, generator=gen)
    with torch.inference_mode():
        got = linear.panel_linear(x, linear.prepare(linear.panel_linear, w), b)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_rows_answer_does_not_depend_on_the_rows_beside_it() -> None:
    """The tile widens at one or two rows (more sums in flight), but each output is still its
    products added in k order: a row alone, in a pair, in a tile of 6 or a block of 64 gives the
    same bits, so a request's greedy tokens do not change with the batch it decodes in."""
    gen = torch.Generator().manual_seed(3)
    w = linear.to_panels(torch.randn(200, 256, generator=gen) * 0.05)
    x = torch.randn(70, 256, generator=gen)
    alone = torch.cat([linear.panel_linear(x[i : i + 1], w) for i in range(len(x))])
    for rows in (2, 3, 6, 7, 64, 70):
        got = torch.cat([linear.panel_linear(x[i : i + rows], w) for i in range(0, len(x), rows)])
        assert torch.equal(got, alone), rows


def test_the_panel_kernel_reads_strided_rows() -> None:
    """A row view with its own stride (a split of a wider tensor) and a column view (made
    contiguous first) give F.linear's answer."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(130, 64, generator=gen)
    wide = torch.randn(9, 200, generator=gen)
    for x in (wide[:, 10:74], wide[:, ::3][:, :64]):
        torch.testing.assert_close(linear.panel_linear(x, linear.to_panels(w)), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_the_panel_kernel_takes_no_rows_and_overlapping_rows() -> None:
    """Zero rows give an empty answer without a call; rows that overlap (a stride below `in`,
    as an unfold makes) are copied out first, since the kernel refuses them."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(70, 16, generator=gen)
    assert linear.panel_linear(torch.empty(0, 16), linear.to_panels(w)).shape == (0, 70)
    overlapping = torch.randn(40, generator=gen).unfold(0, 16, 8)  # [4, 16], stride (8, 1)
    torch.testing.assert_close(linear.panel_linear(overlapping, linear.to_panels(w)), F.linear(overlapping, w),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("sub", [8, 16, 64])
def test_panels_are_the_weight_reordered_not_grown(sub: int) -> None:
    w = torch.arange(200 * 3, dtype=torch.float32).reshape(200, 3)
    panels = linear.to_panels(w, sub=sub)
    assert panels.numel() == w.numel() and panels.is_contiguous()
    for j in range(0, 64, sub):  # the first panel: [in, sub] blocks of its 64 columns in turn
        assert panels[3 * j : 3 * (j + sub)].reshape(3, sub).equal(w[j : j + sub].t())
    assert panels[3 * 192 :].reshape(3, 8).equal(w[192:].t())  # the last: 8 columns wide, one block


def test_panels_take_this_builds_sub_panel_width() -> None:
    """The library is built for this CPU (-march=native): its sub-panel width is its ISA's
    narrowest tile (linear.c), and to_panels writes that layout unless told another."""
    assert linear.subpanel_width() == SUBPANEL_WIDTH[native_isa()]
    w = torch.randn(130, 5)
    assert linear.to_panels(w).equal(linear.to_panels(w, sub=linear.subpanel_width()))
    with pytest.raises(ValueError, match="does not divide"):
        linear.to_panels(w, sub=24)


def test_the_panel_kernel_refuses_what_does_not_fit() -> None:
    w = linear.to_panels(torch.randn(64, 32))
    with pytest.raises(ValueError, match="does not fit"):
        linear.panel_linear(torch.randn(2, 30), w)  # 30 does not divide the weight's 2,048
    with pytest.raises(ValueError, match="does not fit"):
        linear.panel_linear(torch.randn(2, 32), w, torch.randn(63))  # a bias one short
    with pytest.raises(ValueError, match="does not fit"):
        linear.panel_linear(torch.randn(2, 32, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="does not fit"):
        linear.panel_linear(torch.randn(2, 0), w)  # no in-features


def test_onednn_is_next_where_the_kernels_cannot_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    if not linear._onednn_agrees():
        pytest.skip("this torch build has no working oneDNN linear")
    monkeypatch.setattr(linear, "_panels_agree", lambda: False)
    assert linear.select_linear(CPU, torch.float32) is linear.onednn_linear
    monkeypatch.setenv("BATON_CPU_LINEAR", "panel")
    with pytest.raises(RuntimeError, match="cannot be built"):
        linear.select_linear(CPU, torch.float32)
    monkeypatch.setenv("BATON_CPU_LINEAR", "onednn")
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
    assert linear.prepare(linear.panel_linear, w).shape == (32,)
    if linear._onednn_agrees():
        packed = linear.prepare(linear.onednn_linear, w)
        assert packed.layout == torch._mkldnn and packed.shape == w.shape  # type: ignore[attr-defined]


def test_the_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CPU_LINEAR", "torch")
    assert linear.select_linear(CPU, torch.float32) is linear.torch_linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_keep_f_linear(dtype: torch.dtype) -> None:
    assert linear.select_linear(CPU, dtype) is linear.torch_linear


def test_a_build_without_either_falls_back_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "_panels_agree", lambda: False)
    monkeypatch.setattr(linear, "_onednn_agrees", lambda: False)
    assert linear.select_linear(CPU, torch.float32) is linear.torch_linear
    monkeypatch.setenv("BATON_CPU_LINEAR", "onednn")
    with pytest.raises(RuntimeError, match="no working oneDNN linear"):
        linear.select_linear(CPU, torch.float32)


def test_a_bad_switch_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CPU_LINEAR", "mkl")
    with pytest.raises(ValueError, match="BATON_CPU_LINEAR"):
        linear.select_linear(CPU, torch.float32)
