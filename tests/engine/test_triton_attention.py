"""The Triton paged-decode kernel against the torch reference, on CPU under Triton's interpreter.

The same kernel source runs on the GPU (bench/gpu_check.py and the CUDA tests); here
TRITON_INTERPRET=1 executes it with numpy on CPU tensors, so its indexing (page table,
GQA grouping, ragged lengths, masked tails) is checked in `make test` where Triton is
installed, and skipped where it is not.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # read when triton and the kernel are first imported
pytest.importorskip("triton")

from engine.attention import AttnMetadata, paged_attention  # noqa: E402


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    from triton.runtime import interpreter

    # Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a loop bound with
    # int(array), which numpy >= 2.4 refuses; give it the element instead.
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch
    import engine.triton_attention as mod

    yield importlib.reload(mod)  # decorate under the interpreter even if imported before
    interpreter._patch_lang_tensor = original


@pytest.mark.parametrize("partition", [0, 16, 48])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "page"), [(4, 2, 16, 4), (8, 1, 32, 16), (6, 6, 16, 8)])
def test_kernel_matches_torch_reference(kernel, heads: int, kv_heads: int, head_dim: int, page: int, partition: int) -> None:  # type: ignore[no-untyped-def]
    """Whole-context programs (partition 0) and split-KV ones with their merge: a row shorter
    than one partition, rows ending on a partition's edge and inside one, the longest row
    spanning every partition."""
    gen = torch.Generator().manual_seed(heads * 100 + page)
    num_pages = 48
    k_cache = torch.randn(num_pages, page, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_pages, page, kv_heads, head_dim, generator=gen)
    lens = torch.tensor([1, page, page + 1, 3 * page - 1, 70], dtype=torch.int64)
    max_pages = int(-(-lens.max() // page))
    table = torch.randint(0, num_pages, (len(lens), max_pages), generator=gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    ref_meta = AttnMetadata(torch.zeros(len(lens), dtype=torch.int64), (), 0, table, lens, scale)
    want = paged_attention(q, k_cache, v_cache, ref_meta)
    got = kernel.paged_decode(q, k_cache, v_cache, table, lens, scale, block_n=16, partition=partition)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_kernel_refuses_head_dims_it_cannot_tile(kernel) -> None:  # type: ignore[no-untyped-def]
    k = torch.zeros(4, 4, 1, 12)
    with pytest.raises(ValueError, match="head_dim"):
        kernel.paged_decode(torch.zeros(1, 1, 12), k, k, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), 1.0)


def test_split_writes_into_a_strided_out_and_refuses_a_ragged_partition(kernel) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(16, 8, 2, 16, generator=gen)
    v_cache = torch.randn(16, 8, 2, 16, generator=gen)
    table = torch.randint(0, 16, (3, 8), generator=gen)
    lens = torch.tensor([64, 17, 33], dtype=torch.int64)
    q = torch.randn(3, 4, 16, generator=gen)
    want = kernel.paged_decode(q, k_cache, v_cache, table, lens, 0.25, block_n=16, partition=0)
    whole = torch.full((5, 4, 16), 7.0)
    kernel.paged_decode(q, k_cache, v_cache, table, lens, 0.25, block_n=16, partition=16, out=whole[2:])
    torch.testing.assert_close(whole[2:], want, rtol=1e-4, atol=1e-4)
    assert bool((whole[:2] == 7.0).all())  # rows before the slice untouched
    with pytest.raises(ValueError, match="multiple of block_n"):
        kernel.paged_decode(q, k_cache, v_cache, table, lens, 0.25, block_n=16, partition=24)


def test_decode_partition_depends_on_shapes_only(kernel) -> None:  # type: ignore[no-untyped-def]
    choose = kernel.decode_partition
    assert choose(1, 4, 672) == 128  # few programs: finer partitions
    assert choose(64, 4, 672) == 256
    assert choose(64, 4, 256) == 0  # the whole table fits one partition: no split
    assert choose(1, 4, 64) == 0
    wide = choose(8, 8, 131_072)  # a 128k-token table: MAX_SPLITS partitions, not 1,024
    assert wide == 131_072 // kernel.MAX_SPLITS and wide % 64 == 0
    assert choose(1, 1, 1000, block_n=48) % 48 == 0
