"""What a gRPC GenerateRequest asks of its output (the gRPC twin of cluster.edge.openai_output), and
the tool calls of its replies.

    Sampling.constraint       json_object | json_schema | regex | grammar   (one oneof field)
    GenerateRequest.tools     + tool_choice, tool_function, parallel_tool_calls (chat only)

Fields are bounded here, before anything is admitted; a refusal is INVALID_ARGUMENT whose
details start with the field's name ("sampling.regex: ...", "tools.0.parameters: ...").
"""

from __future__ import annotations

import re
from typing import Any

from batonpb.baton.v1 import generation_pb2 as pb
from cluster.edge import constraint_fields as fields
from cluster.edge.constraint_fields import OutputSpec
from cluster.edge.openai_schema import (
    MAX_DESCRIPTION_CHARS,
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    NAME_PATTERN,
)
from cluster.edge.tool_calls import ToolCallParser, ToolChoice, ToolUse, finish_reason
from cluster.errors import invalid
from engine.constraint import Constraint
from engine.outputs import StepOutput, TokenLogprobs
from engine.request import FinishReason

MAX_ID_CHARS = 256
_NAME = re.compile(NAME_PATTERN)
_CHOICES = {
    pb.TOOL_CHOICE_UNSPECIFIED: ToolChoice.AUTO,  # unset: also the auto of clients before issue 24
    pb.TOOL_CHOICE_AUTO: ToolChoice.AUTO,
    pb.TOOL_CHOICE_NONE: ToolChoice.NONE,
    pb.TOOL_CHOICE_REQUIRED: ToolChoice.REQUIRED,
    pb.TOOL_CHOICE_FUNCTION: ToolChoice.FUNCTION,
}


def output_spec(request: pb.GenerateRequest) -> OutputSpec:
    found: list[tuple[str, Constraint]] = []
    kind = request.sampling.WhichOneof("constraint")
    if kind is not None:
        param = f"sampling.{kind}"
        if kind == "json_object":
            if not request.sampling.json_object:
                raise invalid(f"{param}: must be true when set", param)
            found.append((param, Constraint("json_object")))
        else:
            found.append((param, fields.checked(kind, getattr(request.sampling, kind), param)))
    return fields.with_tools(found, _tool_use(request))


def _tool_use(request: pb.GenerateRequest) -> ToolUse | None:
    choice = _CHOICES.get(request.tool_choice)
    if choice is None:
        raise invalid("tool_choice: not a ToolChoice value", "tool_choice")
    if (choice == ToolChoice.FUNCTION) != bool(request.tool_function):
        raise invalid("tool_function: set it with TOOL_CHOICE_FUNCTION, and only then", "tool_function")
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    if not request.tools:
        if choice in (ToolChoice.AUTO, ToolChoice.NONE):
            return None
        raise invalid("tool_choice: only with tools", "tool_choice")
    if not request.chat:
        raise invalid("tools: only with chat = true", "tools")
    if len(request.tools) > MAX_TOOLS:
        raise invalid(f"tools: at most {MAX_TOOLS}", "tools")
    tools = []
    for i, t in enumerate(request.tools):
        if not _NAME.match(t.name):
            raise invalid(f"tools.{i}.name: must match {NAME_PATTERN}", f"tools.{i}.name")
        if len(t.description) > MAX_DESCRIPTION_CHARS:
            raise invalid(f"tools.{i}.description: at most {MAX_DESCRIPTION_CHARS} characters", f"tools.{i}.description")
        param = f"tools.{i}.parameters"
        schema = fields.checked("json_schema", t.parameters, param) if t.parameters else None
        tools.append(fields.new_tool(t.name, t.description, schema, param))
    fields.unique_names(tools, "tools.{}.name")
    if choice == ToolChoice.FUNCTION:
        return fields.named_choice(tuple(tools), request.tool_function, "tool_function", parallel)
    return ToolUse(tuple(tools), choice, None, parallel)


def template_messages(request: pb.GenerateRequest) -> list[dict[str, Any]]:
    """The chat messages as Hugging Face templates read them (tool calls' arguments parsed)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(request.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if len(m.tool_calls) > MAX_TOOL_CALLS:
            raise invalid(f"messages.{i}.tool_calls: at most {MAX_TOOL_CALLS}", f"messages.{i}.tool_calls")
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id[:MAX_ID_CHARS], "type": "function",
                 "function": {"name": c.name, "arguments": fields.parse_arguments(
                     c.arguments, f"messages.{i}.tool_calls.{j}.arguments")}}
                for j, c in enumerate(m.tool_calls)
            ]  # fmt: skip
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id[:MAX_ID_CHARS]
        out.append(message)
    return out


def split_tool_calls(
    msg: pb.GenerateResponse | pb.CompleteResponse | pb.CompleteChoice, parser: ToolCallParser, finished: bool
) -> None:
    """Split a reply's text with the choice's parser: the content stays in `text`, the calls
    (deltas of a stream, whole calls of a Complete) go apart."""
    parsed = parser.feed(msg.text)
    if finished:
        parsed.content.extend(parser.finish().content)
    msg.text = parsed.text
    if isinstance(msg, pb.GenerateResponse):
        msg.tool_calls.extend(
            pb.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "", arguments=d.arguments)
            for d in parsed.calls
        )
    else:
        msg.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in parser.calls)


def ended_in_calls(
    msg: pb.GenerateResponse | pb.CompleteResponse | pb.CompleteChoice, parser: ToolCallParser
) -> None:
    """A reply that stopped after its calls finishes with FINISH_REASON_TOOL_CALLS."""
    if finish_reason("stop" if msg.finish_reason == pb.FINISH_REASON_STOP else None, parser) == "tool_calls":
        msg.finish_reason = pb.FINISH_REASON_TOOL_CALLS


# -- replies ----------------------------------------------------------------------------------

# The engine's finish reasons are named after the proto's enum values.
FINISH = {r: pb.FinishReason.Value(f"FINISH_REASON_{r.name}") for r in FinishReason}


def delta(out: StepOutput, request_id: str, parser: ToolCallParser | None = None) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=request_id, token_ids=out.token_ids, text=out.text,
        logprobs=[logprob(lp) for lp in out.logprobs],
    )
    if parser is not None:
        split_tool_calls(msg, parser, out.finish_reason is not None)
    if out.finish_reason is not None:
        msg.finish_reason = FINISH[out.finish_reason]
        msg.usage.CopyFrom(usage(out))
        if parser is not None:
            ended_in_calls(msg, parser)
    return msg


def logprob(lp: TokenLogprobs) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=top)


def usage(out: StepOutput) -> pb.Usage:
    hit = out.cached
    return pb.Usage(
        prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
        cached_tokens=hit.total,
        cached=pb.CachedTokens(device=hit.device, host=hit.host, disk=hit.disk, remote=hit.remote),
    )
