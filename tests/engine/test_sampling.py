"""SamplingParams: every field is bounded at construction, and the error names the field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.errors import BatonError
from engine.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingError,
    SamplingParams,
)

INVALID: list[tuple[str, dict[str, Any]]] = [
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -5}),
    ("max_tokens", {"max_tokens": 2**31}),
    ("max_tokens", {"max_tokens": 1.0}),
    ("max_tokens", {"max_tokens": True}),
    ("max_tokens", {"max_tokens": "16"}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 17}),  # > max_tokens (16)
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("min_tokens", {"min_tokens": False}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": 2.01}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": True}),
    ("temperature", {"temperature": "1"}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_p", {"top_p": -math.inf}),
    ("top_p", {"top_p": math.nan}),
    ("top_k", {"top_k": -1}),
    ("top_k", {"top_k": 10_001}),
    ("top_k", {"top_k": True}),
    ("top_k", {"top_k": False}),
    ("top_k", {"top_k": 5.0}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.01}),
    ("min_p", {"min_p": math.nan}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": 2.5}),
    ("repetition_penalty", {"repetition_penalty": math.inf}),
    ("presence_penalty", {"presence_penalty": -2.1}),
    ("presence_penalty", {"presence_penalty": 2.1}),
    ("presence_penalty", {"presence_penalty": math.nan}),
    ("frequency_penalty", {"frequency_penalty": 3}),
    ("frequency_penalty", {"frequency_penalty": -math.inf}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": 2**63}),
    ("seed", {"seed": True}),
    ("seed", {"seed": 1.5}),
    ("stop", {"stop": "</s>"}),  # a bare string would stop on each character
    ("stop", {"stop": ("",)}),
    ("stop", {"stop": ("x" * (MAX_STOP_STRING_LEN + 1),)}),
    ("stop", {"stop": tuple(str(i) for i in range(MAX_STOP_STRINGS + 1))}),
    ("stop", {"stop": (1,)}),
    ("stop", {"stop": None}),
    ("stop_token_ids", {"stop_token_ids": (-1,)}),
    ("stop_token_ids", {"stop_token_ids": (True,)}),
    ("stop_token_ids", {"stop_token_ids": (2**31,)}),
    ("stop_token_ids", {"stop_token_ids": tuple(range(MAX_STOP_TOKEN_IDS + 1))}),
    ("stop_token_ids", {"stop_token_ids": 7}),
    ("ignore_eos", {"ignore_eos": 1}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": MAX_LOGPROBS + 1}),
    ("logprobs", {"logprobs": True}),
    ("logit_bias", {"logit_bias": {1: 100.5}}),
    ("logit_bias", {"logit_bias": {1: -101}}),
    ("logit_bias", {"logit_bias": {1: float("nan")}}),
    ("logit_bias", {"logit_bias": {1: True}}),
    ("logit_bias", {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {2**31: 1.0}}),
    ("logit_bias", {"logit_bias": {"5": 1.0}}),  # ids are numbers here (the HTTP edge parses its strings)
    ("logit_bias", {"logit_bias": ((1, 1.0), (1, 2.0))}),
    ("logit_bias", {"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}),
    ("logit_bias", {"logit_bias": "5:1"}),
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID)
def test_invalid_field_is_named(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(SamplingError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    # The message tells the client what is allowed, not just that it was wrong.
    assert "must" in str(info.value) or "at most" in str(info.value)


def test_sampling_error_is_a_value_error_and_a_baton_error() -> None:
    with pytest.raises(ValueError):
        SamplingParams(top_p=2.0)
    assert issubclass(SamplingError, BatonError)


def test_defaults_are_valid_and_not_greedy() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16 and params.temperature == 1.0
    assert not params.is_greedy


def test_temperature_zero_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-9).is_greedy  # too small to divide logits by
    assert not SamplingParams(temperature=0.01).is_greedy


def test_bounds_are_inclusive_where_documented() -> None:
    SamplingParams(
        temperature=2.0,
        top_p=1.0,
        top_k=10_000,
        min_p=1.0,
        repetition_penalty=2.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        seed=2**63 - 1,
        logprobs=MAX_LOGPROBS,
        min_tokens=16,
        stop=tuple("x" * MAX_STOP_STRING_LEN for _ in range(MAX_STOP_STRINGS)),
        stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)),
    )
    SamplingParams(logprobs=0, top_k=0, min_p=0.0, seed=0)


def test_numbers_and_sequences_are_normalised() -> None:
    stop: Any = ["a", "b"]  # lists, as a JSON edge hands them over
    ids: Any = [3]
    params = SamplingParams(temperature=1, top_p=1, stop=stop, stop_token_ids=ids)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert params.stop == ("a", "b") and params.stop_token_ids == (3,)
    assert hash(params) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(3,)))


def test_logit_bias_becomes_sorted_pairs_within_openais_bounds() -> None:
    params = SamplingParams(logit_bias={9: -100, 3: 100.0, 5: 0.5})
    assert params.logit_bias == ((3, 100.0), (5, 0.5), (9, -100.0))
    assert SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS)}).logit_bias[-1] == (MAX_LOGIT_BIAS - 1, 1.0)


def test_params_are_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]


def finite(lo: float, hi: float, *, exclude_min: bool = False) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, exclude_min=exclude_min, allow_nan=False, allow_infinity=False)


@st.composite
def valid_params(draw: st.DrawFn) -> dict[str, Any]:
    max_tokens = draw(st.integers(1, 2**31 - 1))
    return {
        "max_tokens": max_tokens,
        "min_tokens": draw(st.integers(0, max_tokens)),
        "temperature": draw(finite(0.0, 2.0)),
        "top_p": draw(finite(0.0, 1.0, exclude_min=True)),
        "top_k": draw(st.integers(0, 10_000)),
        "min_p": draw(finite(0.0, 1.0)),
        "repetition_penalty": draw(finite(0.0, 2.0, exclude_min=True)),
        "presence_penalty": draw(finite(-2.0, 2.0)),
        "frequency_penalty": draw(finite(-2.0, 2.0)),
        "seed": draw(st.none() | st.integers(0, 2**63 - 1)),
        "stop": tuple(
            draw(
                st.lists(
                    st.text(min_size=1, max_size=MAX_STOP_STRING_LEN), max_size=MAX_STOP_STRINGS
                )
            )
        ),
        "stop_token_ids": tuple(
            draw(st.lists(st.integers(0, 2**31 - 1), max_size=MAX_STOP_TOKEN_IDS))
        ),
        "ignore_eos": draw(st.booleans()),
        "logprobs": draw(st.none() | st.integers(0, MAX_LOGPROBS)),
    }


@given(valid_params())
def test_valid_params_never_raise(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    assert params.is_greedy == (kwargs["temperature"] < 1e-5)
