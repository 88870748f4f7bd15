"""Pydantic models of the OpenAI-compatible request bodies (the only place pydantic is used).

Types are checked strictly and every field is bounded, so /openapi.json documents exactly
what is accepted. Unknown fields are ignored, except fields that would run code on the
server (logits processors by name) and fields of OpenAI's API or of other servers that baton
does not implement and that would change the output (`_OFF`, other servers' constraint
fields), which are refused by name; docs/openai_fields.md lists every field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.edge.frontend import MAX_HINT_CHARS
from engine.sampling import (
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_TOP_K,
)

MAX_CHOICES = 16
MAX_PROMPT_CHARS = 4_000_000  # the body limit bounds it first; this keeps the schema honest
MAX_PROMPT_TOKENS = 1_000_000
MAX_MESSAGES = 2048
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # in one assistant message of the conversation
MAX_DESCRIPTION_CHARS = 65_536
MAX_CONSTRAINT_CHARS = 1 << 20  # engine.constraint bounds each kind far below; this bounds the schema
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's, for functions and json_schema names
# Other servers' constraint fields: ignoring them would return unconstrained text to a client
# that asked for a constraint, so they are refused with the name baton uses.
FOREIGN_CONSTRAINTS = {
    "guided_json": "response_format (json_schema)", "guided_regex": "regex", "guided_grammar": "grammar",
    "guided_choice": "regex or grammar", "ebnf": "grammar", "structured_outputs": "response_format, regex or grammar",
}  # fmt: skip
REFUSED_FIELDS = frozenset(
    {"logits_processors", "logits_processor", "logit_processors", "processors", "custom_logits_processors"}
)
# Fields of OpenAI's API and of vLLM's and SGLang's extensions that baton does not implement
# and that would change the output: refused by name unless absent, null or the value that
# changes nothing (docs/openai_fields.md lists every field and what baton does with it).
_OFF: dict[str, tuple[object, ...]] = {
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "functions": ([],),  # OpenAI's deprecated function calling: use tools
    "function_call": ("none",),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "truncate_prompt_tokens": (),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "continue_final_message": (False,),
    "documents": ([],),
    "mm_processor_kwargs": ({},),
    "echo": (False,),  # Completions' prompt echo, and vLLM's chat extension of it
    "suffix": ("",),  # Completions' insertion: baton completes after the prompt
}

Int32 = Annotated[int, Field(ge=0, le=2**31 - 1)]
StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_LEN)]


def _no_surrogates(text: str, field: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{field} is not valid UTF-8 (lone surrogate)") from None
    return text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="absent: any JSON object")
    strict: bool | None = Field(default=None, description="accepted; the schema is always enforced")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    min_tokens: int = Field(default=0, ge=0, le=2**31 - 1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K, description="-1 or 0: off")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: StopStr | list[StopStr] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[Int32] | None = Field(default=None, max_length=64)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = Field(default=None, max_length=256)
    priority: int | None = Field(default=None, ge=-100, le=100, description="operator-enabled extension")
    slo_class: Literal["latency", "standard", "batch"] | None = Field(
        default=None, description="baton's extension: the request's service class (absent: standard); batch yields "
                                  "its place to the others, latency is refused (403) unless the operator lets "
                                  "callers set scheduling, as for priority")  # fmt: skip
    return_token_ids: bool = Field(default=False, description="add each choice's token ids (vLLM's extension)")
    cache_salt: str | None = Field(default=None, max_length=MAX_HINT_CHARS,
                                   description="vLLM's extension: only requests with the same salt (and tenant) "
                                               "share this request's cached pages")
    prompt_cache_key: str | None = Field(default=None, max_length=MAX_HINT_CHARS,
                                         description="the conversation's key: placement keeps its requests on the "
                                                     "worker holding its pages (gRPC's session_id)")
    response_format: ResponseFormat | None = None
    regex: str | None = Field(default=None, max_length=MAX_CONSTRAINT_CHARS,
                              description="extension: the output matches this regex in full")
    grammar: str | None = Field(default=None, max_length=MAX_CONSTRAINT_CHARS,
                                description="extension: the output is derived by this Lark grammar (llguidance's)")
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS,
        description="token id (a string, as OpenAI's) -> bias added to its logit before sampling: -100 bans it, "
                    "100 all but forces it",
    )  # fmt: skip

    @model_validator(mode="before")
    @classmethod
    def _refuse_code(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refused = sorted(REFUSED_FIELDS & data.keys())
            if refused:
                raise ValueError(f"field {refused[0]!r} would run code on the server and is refused")
            foreign = sorted(FOREIGN_CONSTRAINTS.keys() & data.keys())
            if foreign:
                raise ValueError(f"field {foreign[0]!r} is not baton's: use {FOREIGN_CONSTRAINTS[foreign[0]]}")
            for name in sorted(_OFF.keys() & data.keys()):
                value = data[name]
                if value is not None and not any(value == off and type(value) is type(off) for off in _OFF[name]):
                    raise ValueError(f"field {name!r} is not supported (it would change the output); "
                                     f"see docs/openai_fields.md")
        return data

    @field_validator("stop")
    @classmethod
    def _stop_utf8(cls, value: str | list[str] | None) -> str | list[str] | None:
        for text in [value] if isinstance(value, str) else value or []:
            _no_surrogates(text, "stop")
        return value


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
        | Annotated[list[Int32], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]], Field(min_length=1, max_length=MAX_CHOICES)]
        | Annotated[list[Annotated[list[Int32], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]], Field(min_length=1, max_length=MAX_CHOICES)]
    )
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES,
                                description="accepted only equal to n (every sample is returned); more is refused")

    @model_validator(mode="after")
    def _best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"field 'best_of' ({self.best_of}) other than n ({self.n}) is not supported: "
                             "baton returns every sample it draws; ask for n samples with logprobs and rank them")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt_utf8(cls, value: Any) -> Any:
        texts = [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)]
        for text in texts:
            _no_surrogates(text, "prompt")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=256)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS, description="JSON text")


class MessageToolCall(BaseModel):
    """A tool call an earlier assistant turn made (rendered by the chat template)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None)
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(default=None, max_length=256)

    @field_validator("content")
    @classmethod
    def _content_utf8(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        for text in [value] if isinstance(value, str) else [p.text for p in value or []]:
            _no_surrogates(text, "messages.content")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = Field(default=None, max_length=MAX_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON schema of an object; absent: no arguments")
    strict: bool | None = Field(default=None, description="accepted; the parameters are always enforced")


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=NAME_PATTERN)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="absent: auto with tools, none without")
    parallel_tool_calls: bool = True


# -- the tokenizer routes (vLLM's shapes) --------------------------------------------------------

_TOKENIZE_OFF = ("chat_template", "chat_template_kwargs", "continue_final_message", "documents", "mm_processor_kwargs")


class TokenizeBody(BaseModel):
    """POST /tokenize: a text `prompt`, or chat `messages` rendered by the model's chat template
    as /v1/chat/completions renders them (vLLM's two request shapes, as one body)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(default=None, min_length=1, max_length=256, description="absent: the served model")
    prompt: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = Field(
        default=None, description="absent: true for a prompt, false for messages (their template adds BOS)")
    add_generation_prompt: bool = Field(default=True, description="messages only")
    tools: list[ToolDef] | None = Field(default=None, max_length=MAX_TOOLS, description="messages only")
    return_token_strs: bool = Field(default=False, description="add each token's string in the vocabulary")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in sorted(data.keys() & set(_TOKENIZE_OFF)):
                value = data[name]
                if value is not None and not any(value == off and type(value) is type(off) for off in _OFF[name]):
                    raise ValueError(f"field {name!r} is not supported (it would change the tokens)")
        return data

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("set exactly one of 'prompt' and 'messages'")
        if self.prompt is not None and self.tools is not None:
            raise ValueError("field 'tools' is for messages, not a prompt")
        if self.prompt is not None:
            _no_surrogates(self.prompt, "prompt")
        return self


class DetokenizeBody(BaseModel):
    """POST /detokenize: token ids back to text (special tokens kept, as vLLM's)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(default=None, min_length=1, max_length=256, description="absent: the served model")
    tokens: list[Int32] = Field(max_length=MAX_PROMPT_TOKENS)
