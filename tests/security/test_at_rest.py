"""KV pages at rest are private to the serving user, as the same bytes are in shared memory
(kvtransfer.shm: a 0600 region): a disk tier's directory is created 0700 and its segment
files 0600, whatever the umask lets through. The pages hold every tenant's prompts."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from kvcache.disk import DiskTier

pytestmark = pytest.mark.timeout(120)

SHAPE = (2, 2, 4, 1, 8)


def test_disk_tier_files_are_private(tmp_path: Path) -> None:
    directory = tmp_path / "kv" / "decode-0"
    old = os.umask(0)  # the most permissive umask: the modes below are the code's own
    try:
        tier = DiskTier(directory, bytes(16), SHAPE, torch.float32, capacity_pages=8, sync_every_pages=1)
        try:
            for i in range(3):
                tier.put(bytes([i]) * 16, torch.full(SHAPE, float(i)))
            tier.flush()
            assert len(tier.hashes()) == 3
        finally:
            tier.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    segments = sorted(directory.glob("seg-*.bkv"))
    assert segments, "the tier wrote no segment: this test proves nothing"
    for segment in segments:
        assert stat.S_IMODE(segment.stat().st_mode) == 0o600, segment
