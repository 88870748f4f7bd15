"""What a simulated worker costs (`baton sim`): per-token prefill, decode step time by batch
size, KV bytes per page, and the bandwidths pages move at, taken from runs measured on this
project's machines. A `--calibration FILE.json` with the same fields overrides a built-in one.

    prefill(n uncached tokens, h host pages) = n x prefill_s_per_token + h x page_bytes / host
    decode step(batch b)  = piecewise-linear through decode_step_s [(b, seconds)], extended
                            past the last point by the last segment's slope
    transfer(p pages)     = p x page_bytes / transfer_bytes_per_s[transport]

The built-ins quote their sources (`source`); the figures are CPU figures (2 cores, float32),
so a simulated "GPU" here is a worker as fast as baton's CPU workers, not an accelerator.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

_SMALL_SOURCE = (
    "baton-small (12 layers, 4 KV heads x 64, float32: 393,216 B/page) on the 2-core CPU machines: "
    "prefill 2,000 tokens ~3.0 s on one core (bench.transfer, P8; 5.6 s when re-measured on a loaded "
    "machine 2026-11-29); decode step 31.8 / 56.4 / 100.5 ms at batch 1 / 8 / 32 (README offline "
    "figures); KV push gRPC 0.59 GB/s (commit a13971e), shm ~1.2 GB/s (P8's 1.0-1.5 GB/s), local "
    "1.34 GB/s; host tier -> device 2.7 GB/s page by page (README, host tier)"
)
_TINY_SOURCE = (
    "baton-tiny (4 layers, 2 KV heads x 64, float32: 65,536 B/page) on the 2-core CPU machines: "
    "prefill 2,000 tokens 0.209 s (bench.transfer, 2026-11-29, loaded machine); decode step "
    "5.4 / 9.2 / 15.7 ms at batch 1 / 8 / 32 (README offline figures); KV push as baton-small's "
    "(the same transports), host tier 2.7 GB/s"
)


@dataclass(frozen=True, slots=True)
class Calibration:
    name: str
    source: str  # where the numbers come from, printed with every run
    page_size: int = 16
    page_bytes: int = 393_216
    prefill_s_per_token: float = 1.5e-3
    decode_step_s: tuple[tuple[int, float], ...] = ((1, 0.03177), (8, 0.05636), (32, 0.10045))
    transfer_bytes_per_s: dict[str, float] = field(
        default_factory=lambda: {"grpc": 0.59e9, "shm": 1.2e9, "local": 1.34e9}
    )
    host_bytes_per_s: float = 2.7e9
    slo_ttft_s: float = 10.0  # BENCHMARKS.md's default SLOs for this model
    slo_itl_s: float = 1.0

    def __post_init__(self) -> None:
        points = self.decode_step_s
        if not points or any(b < 1 or s <= 0 for b, s in points) or list(points) != sorted(set(points)):
            raise ValueError("decode_step_s: (batch >= 1, seconds > 0) points, batches increasing")
        if len({b for b, _ in points}) != len(points):
            raise ValueError("decode_step_s: one point per batch size")
        if self.page_size < 1 or self.page_bytes < 1 or self.prefill_s_per_token <= 0 or self.host_bytes_per_s <= 0:
            raise ValueError("page_size, page_bytes, prefill_s_per_token and host_bytes_per_s must be positive")
        if not self.transfer_bytes_per_s or any(v <= 0 for v in self.transfer_bytes_per_s.values()):
            raise ValueError("transfer_bytes_per_s: at least one transport, every bandwidth positive")
        if self.slo_ttft_s <= 0 or self.slo_itl_s <= 0:
            raise ValueError("SLOs must be positive")

    def step_s(self, batch: int) -> float:
        """Decode step time at `batch` running requests (0 for an empty batch)."""
        if batch <= 0:
            return 0.0
        points = self.decode_step_s
        if len(points) == 1:
            return points[0][1]
        i = min(max(1, bisect_left(points, (batch, 0.0))), len(points) - 1)
        (b0, s0), (b1, s1) = points[i - 1], points[i]
        return max(points[0][1] if batch < b0 else 0.0, s0 + (s1 - s0) * (batch - b0) / (b1 - b0))

    def transfer_s(self, num_pages: int, transport: str) -> float:
        return num_pages * self.page_bytes / self.transfer_bytes_per_s[transport]


BUILTIN: dict[str, Calibration] = {
    "baton-small": Calibration("baton-small", _SMALL_SOURCE),
    "baton-tiny": Calibration(
        "baton-tiny", _TINY_SOURCE, page_bytes=65_536, prefill_s_per_token=0.209 / 2000,
        decode_step_s=((1, 0.00538), (8, 0.00916), (32, 0.01567)), slo_ttft_s=2.0, slo_itl_s=0.2,
    ),
}


def load_calibration(spec: str) -> Calibration:
    """A built-in name, or a JSON file of Calibration's fields (unknown keys rejected; missing
    ones default to baton-small's); its `name` defaults to the file's name."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"calibration {spec!r}: not a file, nor one of {', '.join(BUILTIN)}")
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"calibration {spec}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"calibration {spec}: a JSON object of fields expected")
    known = {f.name for f in fields(Calibration)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"calibration {spec}: unknown keys {unknown}; fields are {sorted(known)}")
    raw.setdefault("name", path.name)
    raw.setdefault("source", f"file {path}")
    if "decode_step_s" in raw:
        raw["decode_step_s"] = tuple((int(b), float(s)) for b, s in raw["decode_step_s"])
    if "transfer_bytes_per_s" in raw:
        raw["transfer_bytes_per_s"] = {str(k): float(v) for k, v in raw["transfer_bytes_per_s"].items()}
    try:
        return Calibration(**raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"calibration {spec}: {exc}") from None
