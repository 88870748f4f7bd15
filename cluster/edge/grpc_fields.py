"""A gRPC request's fields, bounded before anything is admitted (the gRPC twin of
cluster.edge.openai_schema): a message that does not parse, the prompt's shape, the number of
samples and the sampling fields. A refusal is INVALID_ARGUMENT naming the field.

    tolerant(Message)        the request deserializer: a message that does not parse becomes
                             MALFORMED, which check_parsed refuses (grpc's own path answers
                             UNKNOWN with the decoder's exception class)
    check_prompt, num_samples, build_sampling
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batonpb.baton.v1 import generation_pb2 as pb
from cluster.errors import invalid
from engine.sampling import SamplingParams

MAX_MODEL_NAME_CHARS = 256
MAX_PROMPT_CHARS = 4_000_000  # as the HTTP API; the message size limit bounds it first
MAX_PROMPT_TOKENS = 1_000_000  # ids in one call, as the HTTP API's
MAX_MESSAGES = 2048
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_PRIORITY = 100
MAX_SAMPLES = 16  # n, as the HTTP API's


class _Malformed:
    """What a request that does not parse as its message becomes (INVALID_ARGUMENT, not the
    UNKNOWN with the decoder's exception class that grpc's own deserializer path answers)."""


MALFORMED = _Malformed()


def tolerant(message: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except Exception:  # DecodeError, and whatever else a hostile byte string provokes
            return MALFORMED

    return parse


def check_parsed(request: object) -> None:
    if request is MALFORMED:
        raise invalid("the request is not a valid protobuf message of this method's type", None)


def num_samples(request: pb.GenerateRequest) -> int:
    if request.n > MAX_SAMPLES:
        raise invalid(f"n: 0 (one sample) to {MAX_SAMPLES}, got {request.n}", "n")
    return max(1, request.n)


def check_prompt(request: pb.GenerateRequest, max_model_len: int) -> None:
    """Bound the prompt's shape before anything is tokenized or copied."""
    kind = request.WhichOneof("prompt")
    if request.chat:
        if kind is not None:
            raise invalid("prompt: must be unset when chat is true (use messages)", "prompt")
        if not 1 <= len(request.messages) <= MAX_MESSAGES:
            raise invalid(f"messages: 1 to {MAX_MESSAGES} messages when chat is true", "messages")
        for m in request.messages:
            if m.role not in CHAT_ROLES:
                roles = ", ".join(sorted(CHAT_ROLES))
                raise invalid(f"messages.role: must be one of {roles}", "messages.role")
        if sum(len(m.content) for m in request.messages) > MAX_PROMPT_CHARS:
            too_long = f"messages.content: at most {MAX_PROMPT_CHARS} characters in all"
            raise invalid(too_long, "messages.content")
        return
    if request.messages:
        raise invalid("messages: only with chat = true", "messages")
    if kind is None:
        raise invalid("prompt: set text or token_ids (or chat with messages)", "prompt")
    size = len(request.text) if kind == "text" else len(request.token_ids.ids)
    limit = MAX_PROMPT_CHARS if kind == "text" else max_model_len - 1
    if not 1 <= size <= limit:
        raise invalid(f"prompt: {kind} must have 1 to {limit} elements, got {size}", "prompt")


def build_sampling(s: pb.Sampling, default_max_tokens: int) -> SamplingParams:
    """SamplingParams from the message (its constructor bounds every field, naming the bad
    one); `default_max_tokens` where it gives none (Frontend.default_max_tokens: the rest of
    the context)."""
    return SamplingParams(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else default_max_tokens,
        min_tokens=s.min_tokens,
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        logit_bias=tuple(s.logit_bias.items()),
    )
