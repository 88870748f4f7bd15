"""Configuration of the cache tiers below the device pool, and their construction (which alone
imports torch: a config is read where no engine runs, engine.engine_config)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvcache.disk import DiskTier
    from kvcache.host import HostTier
    from kvcache.pool import KVLayout


@dataclass(frozen=True, slots=True)
class TierConfig:
    host_pages: int = 0  # pages in the host-RAM slab; 0 turns the tier off
    disk_pages: int = 0  # pages on local disk; 0 turns the tier off
    disk_dir: str | None = None  # required when disk_pages > 0; survives restarts
    disk_segment_bytes: int = 64 << 20  # records are appended to segment files of this size
    page_ttl_s: float | None = None  # cached pages older than this are not reused
    # > 0: a sequence's pages are also written to the disk tier, this many at a time, as they are
    # cached (they stay on the device): a worker that dies leaves them on its disk, where its
    # restarted self re-indexes them (recovery.write_back_pages; 0: only eviction writes back)
    write_back_pages: int = 0

    def __post_init__(self) -> None:
        if self.host_pages < 0 or self.disk_pages < 0 or self.write_back_pages < 0:
            raise ValueError("tier capacities and write_back_pages must be >= 0")
        if self.disk_pages and not self.disk_dir:
            raise ValueError("disk_pages needs disk_dir")
        if self.write_back_pages and not self.disk_pages:
            raise ValueError("write_back_pages needs the disk tier (disk_pages, disk_dir)")


def build_tiers(
    cfg: TierConfig, layout: KVLayout, dtype: torch.dtype, fingerprint: bytes, pin: bool
) -> tuple[HostTier | None, DiskTier | None]:
    from kvcache.disk import DiskTier
    from kvcache.host import HostTier

    host = HostTier(layout, cfg.host_pages, dtype, pin) if cfg.host_pages else None
    disk = None
    if cfg.disk_pages and cfg.disk_dir:
        shape = (layout.num_layers, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
        disk = DiskTier(Path(cfg.disk_dir), fingerprint, shape, dtype, cfg.disk_pages, cfg.disk_segment_bytes)
    return host, disk
