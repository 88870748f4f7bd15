"""The compiled CPU decode attention against the torch path (the reference), on random pools:
rows of many lengths, GQA, prefixes shared by some rows, contexts long enough to be split."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine import cpu_kernels
from engine.attention import AttnMetadata, paged_attention
from engine.cpu_kernels import SPLIT_PAGES, DecodePlan, paged_decode

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def kernel() -> object:
    lib = cpu_kernels.load()
    assert lib is not None, "the C compiler (cc) is part of the setup: the kernel must build here"
    return lib


def _batch(
    seed: int, lens: list[int], shared: dict[int, tuple[int, int]], page: int, kv_heads: int, dim: int,
    num_pages: int = 4000,
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], list[int]]:  # fmt: skip
    """A random pool and each row's page ids; rows in `shared` (row -> (prefix, pages of it))
    start with that prefix's pages."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    k_cache = torch.randn(num_pages, page, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_pages, page, kv_heads, dim, generator=gen)
    free = list(range(num_pages))
    rng.shuffle(free)
    prefixes = {name: [free.pop() for _ in range(200)] for name, _ in shared.values()}
    rows = []
    for r, n in enumerate(lens):
        name, num = shared.get(r, (-1, 0))
        lead = prefixes[name][:num] if num else []
        rows.append(lead + [free.pop() for _ in range(-(-n // page) - len(lead))])
    return k_cache, v_cache, rows, lens


def _torch_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[list[int]], lens: list[int]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    meta = AttnMetadata(torch.zeros(len(rows), dtype=torch.int64), (), 0, table, torch.tensor(lens), q.shape[-1] ** -0.5)
    return paged_attention(q, k, v, meta)


@pytest.mark.parametrize(
    ("page", "heads", "kv_heads", "dim"), [(16, 4, 2, 64), (16, 12, 4, 64), (4, 8, 8, 32), (16, 2, 1, 128)]
)
def test_decode_matches_the_torch_path(kernel: object, page: int, heads: int, kv_heads: int, dim: int) -> None:
    lens = [1, 2, page, page + 1, 3 * page - 1, 700, 2 * SPLIT_PAGES * page + 5, 37]
    k, v, rows, lens = _batch(1, lens, {}, page, kv_heads, dim)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(2))
    plan = DecodePlan.build([(r, n) for r, n in zip(rows, lens, strict=True)], [-1] * len(rows), page, heads, dim)
    assert plan.num_shared_pages == 0 and len(plan.items) > len(rows)  # the long rows were split
    out = torch.empty_like(q)
    paged_decode(kernel, q, k, v, plan, dim**-0.5, out)  # type: ignore[arg-type]
    torch.testing.assert_close(out, _torch_path(q, k, v, rows, lens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("lens", "threads", "parts"), [
    ([20 * 16], 2, [2]),  # one row, two threads: halves of 10 pages
    ([20 * 16], 4, [4]),  # quarters of 5 pages
    ([5 * 16], 4, [2]),  # no part below MIN_SPLIT_PAGES (4 pages): 4 + 1
    ([3 * 16], 2, [1]),  # too short to split
    ([20 * 16, 20 * 16], 2, [1, 1]),  # a row a thread already
    ([80 * 16], 2, [3]),  # no part above SPLIT_PAGES (32 pages)
])  # fmt: skip
def test_fewer_rows_than_threads_split_finer_and_match(kernel: object, lens: list[int], threads: int, parts: list[int]) -> None:
    page, heads, kv_heads, dim = 16, 4, 2, 64
    k, v, rows, lens = _batch(6, lens, {}, page, kv_heads, dim)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(7))
    plan = DecodePlan.build([(r, n) for r, n in zip(rows, lens, strict=True)], [-1] * len(rows), page, heads, dim, threads)
    assert [int(n) for n in np.diff(plan.row_ptr)] == parts
    out = torch.empty_like(q)
    paged_decode(kernel, q, k, v, plan, dim**-0.5, out)  # type: ignore[arg-type]
    torch.testing.assert_close(out, _torch_path(q, k, v, rows, lens), rtol=1e-5, atol=1e-5)


def test_rows_sharing_a_prefix_read_it_once_and_match(kernel: object) -> None:
    page, heads, kv_heads, dim = 16, 8, 2, 64
    # rows 0-4 share a 150-page prefix (a 2.4k-token document); 5-6 share 3 pages; 7 is alone.
    # Row 3's context ends inside the prefix's last page: it shares only the full pages before.
    lens = [150 * page + 40, 150 * page + 1, 151 * page + 3, 150 * page, 152 * page, 3 * page + 9, 4 * page, 90]
    shared = {0: (0, 150), 1: (0, 150), 2: (0, 150), 3: (0, 150), 4: (0, 150), 5: (1, 3), 6: (1, 3)}
    k, v, rows, lens = _batch(3, lens, shared, page, kv_heads, dim)
    keys = [rows[0][0]] * 5 + [rows[5][0]] * 2 + [-1]
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(4))
    plan = DecodePlan.build([(r, n) for r, n in zip(rows, lens, strict=True)], keys, page, heads, dim)
    assert plan.num_shared_pages == 149 + 3  # row 3 keeps its last page's keys its own
    out = torch.empty_like(q)
    paged_decode(kernel, q, k, v, plan, dim**-0.5, out)  # type: ignore[arg-type]
    torch.testing.assert_close(out, _torch_path(q, k, v, rows, lens), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused(kernel: object) -> None:
    k, v, rows, lens = _batch(5, [5], {}, 16, 2, 64)
    plan = DecodePlan.build([(rows[0], 5)], [-1], 16, 3, 64)
    q = torch.randn(1, 3, 64)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="unsupported shape"):
        paged_decode(kernel, q, k, v, plan, 0.125, torch.empty_like(q))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float32"):
        paged_decode(kernel, q.double(), k, v, plan, 0.125, torch.empty_like(q))  # type: ignore[arg-type]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shared_prefix", [False, True])
def test_16_bit_kv_is_read_in_place_like_the_torch_path_widens_it(kv_dtype: torch.dtype, shared_prefix: bool) -> None:
    """kv_cache_dtype: the kernel built for 16-bit KV widens each key and value as it reads it;
    the torch path widens the gathered pages: the same numbers, computed in float32."""
    lib = cpu_kernels.load(kv_dtype)
    assert lib is not None and lib is not cpu_kernels.load(torch.float32)  # a library of its own
    page, heads, kv_heads, dim = 16, 4, 2, 64
    lens = [40 * page + 3, 40 * page + 9, 2 * SPLIT_PAGES * page + 5, 1, 37]
    shared = {0: (0, 40), 1: (0, 40)} if shared_prefix else {}
    k, v, rows, lens = _batch(5, lens, shared, page, kv_heads, dim, num_pages=1000)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    keys = [rows[0][0]] * 2 + [-1] * 3 if shared_prefix else [-1] * len(lens)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(6))
    plan = DecodePlan.build([(r, n) for r, n in zip(rows, lens, strict=True)], keys, page, heads, dim)
    assert (plan.num_shared_pages > 0) == shared_prefix
    out = torch.empty_like(q)
    paged_decode(lib, q, k, v, plan, dim**-0.5, out)
    torch.testing.assert_close(out, _torch_path(q, k, v, rows, lens), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="not built for"):
        paged_decode(cpu_kernels.load(torch.float32), q, k, v, plan, dim**-0.5, out)  # type: ignore[arg-type]
