"""The engine side of a gateway with no workers of its own (`pools: {baton: {kind: baton,
enabled: false}}`): a router over its external pools, behind the same OpenAI and gRPC edges,
`/metrics`, `/status` and dashboard as any baton gateway, with no model loaded and no step
thread.

It serves no model, so the edges answer only the pools' models (the gateway's routing middleware
and gRPC send them on before the edge would look for an engine); what it offers the edge is a
tokenizer for route tokens where a pool names none: baton's built-in one (engine/assets),
which hashes the same text to the same pages every time, all the approximate index needs. A
pool whose engine publishes KV events names its own (`tokenizer:`), whose ids the events carry.

    front = RouterFront()        is_alive and is_live always (its pools' health is the router's:
                                 an ejected endpoint takes no calls, a 503 says all are out)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from cluster.errors import EdgeError, Kind
from engine.builtin import ASSETS_DIR
from engine.job import Job
from engine.outputs import StepOutput, StepStats
from engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class _Facts:
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


class _NoModel:
    """The ModelView of no model: a tokenizer, no context (max_model_len 0)."""

    def __init__(self) -> None:
        self.tokenizer = Tokenizer.from_dir(ASSETS_DIR)
        self.max_model_len = 0
        self.model_config = _Facts(self.tokenizer.vocab_size)


class RouterFront:
    def __init__(self) -> None:
        self._model = _NoModel()

    @property
    def engine(self) -> _NoModel:
        return self._model

    @property
    def is_alive(self) -> bool:
        return True

    def is_live(self, max_heartbeat_age_s: float) -> bool:
        return True

    @property
    def last_stats(self) -> StepStats | None:
        return None

    async def generate(self, job: Job) -> AsyncIterator[StepOutput]:
        raise EdgeError(Kind.NOT_FOUND, "this gateway runs no model of its own (pools.baton.enabled: false)", "model")
        yield  # an async generator, as the other engine sides' generate is

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
