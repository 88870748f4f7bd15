"""kvtransfer.transport.read_ahead: the reads a push's sender and receiver keep in flight while
they work on a chunk. In order, never more than `depth` items read before they are taken, the
source's error after the items before it, and closing stops the reading. (Over real gRPC
streams: tests/kvtransfer/test_transports.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvtransfer.transport import read_ahead

pytestmark = pytest.mark.timeout(30)


class Source:
    """Yields 0..n-1 (then raises `error`, if set), counting what was read."""

    def __init__(self, n: int, error: Exception | None = None) -> None:
        self.n, self.error = n, error
        self.read = 0
        self.closed = False

    async def items(self) -> AsyncIterator[int]:
        try:
            for i in range(self.n):
                await asyncio.sleep(0)
                self.read += 1
                yield i
            if self.error is not None:
                raise self.error
        finally:
            self.closed = True


async def settle() -> None:
    for _ in range(20):  # let the reader run as far as it may
        await asyncio.sleep(0)


@pytest.mark.parametrize("depth", [1, 2, 4])
async def test_reads_at_most_depth_ahead_in_order(depth: int) -> None:
    source = Source(10)
    got = []
    async for item in read_ahead(source.items(), depth):
        await settle()  # the caller works: the reader fills what room there is
        assert source.read - len(got) <= depth + 1, "read more than depth ahead of the caller"
        assert source.read == min(10, len(got) + 1 + depth)  # ... and it did fill it
        got.append(item)
    assert got == list(range(10))


async def test_an_error_comes_after_the_items_read_before_it() -> None:
    source = Source(3, RuntimeError("stream broke"))
    got = []
    with pytest.raises(RuntimeError, match="stream broke"):
        async for item in read_ahead(source.items(), 2):
            got.append(item)
    assert got == [0, 1, 2]


async def test_closing_early_stops_the_reading() -> None:
    source = Source(100)
    ahead = read_ahead(source.items(), 2)
    assert await anext(ahead) == 0
    await settle()
    await ahead.aclose()
    await settle()
    assert source.read == 3 and source.closed


def test_depth_is_at_least_one() -> None:
    with pytest.raises(ValueError):
        asyncio.run(anext(read_ahead(Source(1).items(), 0)))
