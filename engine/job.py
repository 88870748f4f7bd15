"""One request, as one value from the edge to the engine side: built once by the edge (its
defaults applied there, max_tokens included), then passed whole -- to an AsyncEngine, the
in-process prefill/decode pair, the Ray fleet, and on to the prefill worker that computes its
prompt and the decode worker that reserves its pages and resumes it (kvtransfer.jobs)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import SloClass
from engine.sampling import SamplingParams
from kvcache.hashing import tenant_of


@dataclass(frozen=True, slots=True)
class Job:
    req_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0
    # Prefix pages are shared only under the same salt: the tenant's name, then, when the
    # request gave one, SALT_SEPARATOR and its own cache_salt (kvcache.hashing.cache_salt).
    cache_salt: str = ""
    session: str = ""  # the request's session key: placement keeps a session where its pages are
    # A request that moved (its decode worker was lost): the prompt's last num_resumed tokens
    # are output it already emitted, and its constraint's grammar resumes after them.
    num_resumed: int = 0
    # Its service class (engine.request.SloClass): scheduling order and preemption on every
    # worker, a share of admission at the edge, whether a busy decode worker prefills it.
    slo: SloClass = SloClass.STANDARD
    # False: every page of the prompt is computed, whatever the cache holds (a migration with
    # recovery.preserve_kv off: the recompute baseline that preserved pages are measured against).
    reuse_cache: bool = True

    @property
    def tenant(self) -> str:
        """The tenant the salt belongs to (fairness, purges), without a request's own salt."""
        return tenant_of(self.cache_salt)
