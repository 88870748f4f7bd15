"""One request, as one value from the edge to the engine side: built once by the edge (its
defaults applied there, max_tokens included), then passed whole -- to an AsyncEngine, the
in-process prefill/decode pair, the Ray fleet, and on to the prefill worker that computes its
prompt and the decode worker that reserves its pages and resumes it (kvtransfer.jobs)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class Job:
    req_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0
    cache_salt: str = ""  # the tenant's: prefix pages are shared only under the same salt
