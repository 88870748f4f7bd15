"""What a step costs, learned from the steps this engine ran: the scheduler's inter-token target
(SchedulerConfig.itl_target_s) turns it into a prefill budget per step, stall-free batching as
in Sarathi-Serve: decode rows always run; prefill chunks fill what the target leaves.
`StepWorth` (below) is what the least-uncached policy weighs a burst's prompts with.

    model = StepCostModel()
    model.observe(StepShape(...), seconds)   after every step (its forward pass)
    model.predict(shape)                     seconds
    model.prefill_budget(decodes, target_s, prefill_context)   prefill tokens that fit

A step's time is modelled as linear in what it computes:

    t = c0 + c1 * prefill tokens + c2 * prefill keys read (each new token x its context, / 1k)
           + c3 * decode rows + c4 * decode keys read (/ 1k)

fitted by recursive least squares with forgetting (FORGET per step: the last few hundred steps
count), so the costs follow the machine (a neighbour's load, a thermal limit). Until WARMUP
steps have been seen there is no budget (None): the scheduler then uses its static one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

FORGET = 0.995
WARMUP = 8
_PRIOR = 1e3  # the initial covariance: weak beliefs, quickly overruled


class StepShape(NamedTuple):
    prefill_tokens: int = 0
    prefill_keys: int = 0  # sum over prefill chunks of new tokens x their context length
    decode_rows: int = 0
    decode_keys: int = 0  # sum of the decode rows' context lengths

    def features(self) -> np.ndarray:
        return np.array([1.0, self.prefill_tokens, self.prefill_keys / 1e3, self.decode_rows, self.decode_keys / 1e3])


class StepCostModel:
    def __init__(self) -> None:
        self.theta = np.zeros(5)
        self.cov = np.eye(5) * _PRIOR
        self.num_observed = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not seconds > 0 or not (shape.prefill_tokens or shape.decode_rows):
            return
        x = shape.features()
        px = self.cov @ x
        gain = px / (FORGET + x @ px)
        self.theta = self.theta + gain * (seconds - x @ self.theta)
        self.cov = (self.cov - np.outer(gain, px)) / FORGET
        self.num_observed += 1

    def predict(self, shape: StepShape) -> float:
        return float(shape.features() @ self.theta)

    def prefill_budget(self, decodes: StepShape, target_s: float, context: int) -> int | None:
        """Prefill tokens a step with these decode rows can add and stay within `target_s`,
        for chunks attending about `context` keys each; None while the model is unfitted."""
        if self.num_observed < WARMUP:
            return None
        per_token = self.theta[1] + self.theta[2] * context / 1e3
        if not per_token > 0:
            return None  # not yet a sensible fit (a step's cost must grow with its tokens)
        left = target_s - self.predict(decodes)
        return max(0, int(left / per_token))


EMA = 0.1  # StepWorth: the weight of the newest step in its running averages


def key_weight(num_layers: int, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
               head_dim: int) -> float:  # fmt: skip
    """A model's attention FLOPs per (prompt token, key it reads) over its projections' FLOPs
    per prompt token: how much of a token's work one more key of context is."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    projections = 2 * num_layers * (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * intermediate)
    attention = 4 * num_layers * q  # q.k and p.v, two FLOPs a multiply-add, per head dimension
    return attention / projections


class StepWorth:
    """What one more step costs and what a prompt chunk costs, from the steps this engine ran,
    for least-uncached's burst rule (engine.scheduler, STEP_WORTH). Two running averages, each
    of one well-measured quantity (a regression over step shapes confounds the fixed cost with
    the decode rows when, as under steady load, their number hardly changes):

        step_s   a step without prompt work (what every step costs at the present decode load)
        unit_s   a prompt token's work, per unit of tokens x (1 + context x key_weight): a prompt
                 step's time beyond step_s (all of it before step_s is known), over its work

    `key_weight` (the model's attention FLOPs per key over its projection FLOPs per token) puts
    a token with a long context on the same scale as one without. Both are None until measured."""

    def __init__(self, key_weight: float = 0.0) -> None:
        self.key_weight = key_weight
        self.step_s: float | None = None
        self.unit_s: float | None = None

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not seconds > 0:
            return
        if not shape.prefill_tokens:
            if shape.decode_rows:
                self.step_s = seconds if self.step_s is None else self.step_s + EMA * (seconds - self.step_s)
            return
        # before any step without prompt work, all of the step counts as prompt work: an
        # overestimate (a burst is split sooner) that the next steps correct
        unit = max(0.0, seconds - (self.step_s or 0.0)) / (shape.prefill_tokens + self.key_weight * shape.prefill_keys)
        self.unit_s = unit if self.unit_s is None else self.unit_s + EMA * (unit - self.unit_s)

    def chunk_s(self, tokens: int, context: int) -> float | None:
        """Seconds a chunk of `tokens` after `context` computed ones adds to a step (keys as
        StepShape counts them); None until measured."""
        if self.unit_s is None:
            return None
        return self.unit_s * (tokens + self.key_weight * tokens * (context + tokens))
