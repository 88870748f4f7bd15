"""What a step costs, learned from the steps this engine ran: the scheduler's inter-token target
(SchedulerConfig.itl_target_s) turns it into a prefill budget per step, stall-free batching as
in Sarathi-Serve: decode rows always run; prefill chunks fill what the target leaves. The
least-uncached policy uses the fixed cost c0 (`step_overhead`) to decide how much prompt work
one step is worth (engine.scheduler, STEP_WORTH).

    model = StepCostModel()
    model.observe(StepShape(...), seconds)   after every step (its forward pass)
    model.predict(shape)                     seconds
    model.prefill_budget(decodes, target_s, prefill_context)   prefill tokens that fit
    model.step_overhead(), model.prefill_cost(tokens, context)   c0; one chunk's seconds

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

    def step_overhead(self) -> float | None:
        """c0, what a step costs whatever it computes (on a CPU mostly reading the weights; on
        a GPU launches and the host's work); None while unfitted or not a sensible fit."""
        if self.num_observed < WARMUP or not self.theta[0] > 0:
            return None
        return float(self.theta[0])

    def prefill_cost(self, tokens: int, context: int) -> float:
        """Seconds a prompt chunk of `tokens` after `context` computed ones adds to a step."""
        return max(0.0, float(self.theta[1] * tokens + self.theta[2] * tokens * (context + tokens) / 1e3))

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
