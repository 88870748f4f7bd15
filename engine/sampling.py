"""A request's sampling parameters, validated when they are built.

The HTTP and gRPC edges build a `SamplingParams` straight from client fields and rely on the
constructor to bound every one of them before anything is allocated (docs/architecture.md, Rules), so
each field is checked for its type (a bool is not an int here, NaN and infinities are refused)
and its range, and a bad one raises `SamplingError` naming the field and what is allowed.
The one bound checked elsewhere is `max_tokens` against the model's context, which only the
engine knows. An output constraint (`constraint`, engine.constraint) is bounded by its own
constructor and compiled by the engine when the request arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.constraint import Constraint
from engine.errors import BatonError

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256  # characters
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # entries, as OpenAI bounds it
MAX_BIAS = 100.0  # |bias| at most, as OpenAI bounds it
MAX_TOP_K = 10_000
MAX_TEMPERATURE = 2.0
# Token counts and token ids travel as int32 on the device; this bounds them before the
# engine's own context-length check.
MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1
# Below this temperature a request is treated as greedy: dividing logits by a denormal
# temperature overflows float32 to inf, and inf - inf is NaN (vLLM uses the same epsilon).
GREEDY_TEMPERATURE = 1e-5


class SamplingError(BatonError, ValueError):
    """A sampling field is out of its type or range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _int(field: str, value: object, lo: int, hi: int) -> int:
    # bool is a subclass of int; `"max_tokens": true` is a client bug, not the number 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise SamplingError(field, f"must be an integer in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise SamplingError(field, f"must be in [{lo}, {hi}], got {value}")
    return value


def _float(field: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise SamplingError(field, f"must be a number in {_range(lo, hi, lo_open)}")
    number = float(value)
    if not math.isfinite(number):
        raise SamplingError(field, f"must be a finite number in {_range(lo, hi, lo_open)}")
    if number > hi or number < lo or (lo_open and number == lo):
        raise SamplingError(field, f"must be in {_range(lo, hi, lo_open)}, got {number}")
    return number


def _range(lo: float, hi: float, lo_open: bool) -> str:
    return f"{'(' if lo_open else '['}{lo}, {hi}]"


def _stop_strings(value: object) -> tuple[str, ...]:
    # A bare string is iterable too: refuse it rather than stop on each of its characters.
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise SamplingError("stop", "must be a tuple of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise SamplingError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
    for item in value:
        if not isinstance(item, str):
            raise SamplingError("stop", "must be a tuple of strings")
        if not 1 <= len(item) <= MAX_STOP_STRING_LEN:
            raise SamplingError(
                "stop", f"each stop string must have 1 to {MAX_STOP_STRING_LEN} characters"
            )
    return tuple(value)


def _stop_token_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, tuple | list):
        raise SamplingError("stop_token_ids", "must be a tuple of token ids")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise SamplingError(
            "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(value)}"
        )
    return tuple(_int("stop_token_ids", item, 0, MAX_INT32) for item in value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """{token id: bias} or (id, bias) pairs -> the pairs sorted by id; OpenAI's bounds."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, tuple | list):
        raise SamplingError("logit_bias", "must map token ids to biases")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise SamplingError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(pairs)}")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise SamplingError("logit_bias", "must map token ids to biases")
        token = _int("logit_bias", pair[0], 0, MAX_INT32)
        if token in out:
            raise SamplingError("logit_bias", f"each token id at most once; {token} appears twice")
        out[token] = _float("logit_bias", pair[1], -MAX_BIAS, MAX_BIAS)
    return tuple(sorted(out.items()))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each token of one request (OpenAI / vLLM semantics)."""

    max_tokens: int = 16  # >= 1; the model's context bounds it further (engine)
    min_tokens: int = 0  # EOS and stop ids are blocked until this many tokens exist
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off; clamped to the vocabulary at use
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # the sampled token's logprob plus this many alternatives
    # (token id, bias) pairs added to the raw logits before any other step (OpenAI's logit_bias:
    # -100 bans a token, +100 all but forces it); ids checked against the vocabulary by the engine
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The output must match this JSON schema / regex / grammar (structured output); None: free.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        # Normalise as we check: numbers become float, sequences tuples (hashable, frozen).
        setf = object.__setattr__
        max_tokens = _int("max_tokens", self.max_tokens, 1, MAX_INT32)
        _int("min_tokens", self.min_tokens, 0, max_tokens)
        setf(self, "temperature", _float("temperature", self.temperature, 0.0, MAX_TEMPERATURE))
        setf(self, "top_p", _float("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        _int("top_k", self.top_k, 0, MAX_TOP_K)  # 0 is off, so the range is [0, MAX_TOP_K]
        setf(self, "min_p", _float("min_p", self.min_p, 0.0, 1.0))
        setf(
            self,
            "repetition_penalty",
            _float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True),
        )
        setf(self, "presence_penalty", _float("presence_penalty", self.presence_penalty, -2, 2))
        setf(self, "frequency_penalty", _float("frequency_penalty", self.frequency_penalty, -2, 2))
        if self.seed is not None:
            _int("seed", self.seed, 0, MAX_SEED)
        setf(self, "stop", _stop_strings(self.stop))
        setf(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError("ignore_eos", "must be true or false")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        setf(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise SamplingError("constraint", "must be a Constraint (engine.constraint)")

    @property
    def is_greedy(self) -> bool:
        """True when the token is the argmax (temperature 0, or too small to divide by)."""
        return self.temperature < GREEDY_TEMPERATURE
