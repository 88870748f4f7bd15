"""What an OpenAI request asks of its output: a constraint, tool calls, and the conversation as
the chat template reads it. Pure checks (no I/O): every refusal is a 400 naming the field.

    response_format {"type": "text"}                   free text
                    {"type": "json_object"}            any JSON object
                    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    regex     (baton's extension)                      the output matches it in full
    grammar   (baton's extension)                      a Lark grammar, as llguidance reads it
    tools + tool_choice (+ parallel_tool_calls)        cluster.edge.tool_calls

At most one of them constrains a request (tool_choice none constrains nothing, so it combines
with any). The bounds are engine.constraint's, checked here before anything is admitted;
compiling waits for Frontend.prepare_constraint, which also names the field when it fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.edge import constraint_fields as fields
from cluster.edge.constraint_fields import OutputSpec
from cluster.edge.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeBody,
    ToolDef,
)
from cluster.edge.tool_calls import Tool, ToolChoice, ToolUse
from cluster.errors import invalid
from engine.constraint import Constraint


def output_spec(body: CompletionRequest | ChatCompletionRequest) -> OutputSpec:
    found: list[tuple[str, Constraint]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", Constraint("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        param = "response_format.json_schema"
        if fmt.json_schema is None:
            raise invalid(f"{param}: required when type is json_schema", param)
        schema, param = fmt.json_schema.schema_, param + ".schema"
        found.append((param, Constraint("json_object") if schema is None else fields.schema_value(schema, param)))
    for kind in ("regex", "grammar"):
        text = getattr(body, kind)
        if text is not None:
            found.append((kind, fields.checked(kind, text, kind)))
    tools = _tool_use(body) if isinstance(body, ChatCompletionRequest) else None
    return fields.with_tools(found, tools)


def template_messages(body: ChatCompletionRequest | TokenizeBody) -> list[dict[str, Any]]:
    """The messages as Hugging Face chat templates read them (tool calls' arguments parsed)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages or ()):
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": fields.parse_arguments(
                     c.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments")}}
                for j, c in enumerate(m.tool_calls)
            ]  # fmt: skip
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def checked_tools(defs: Sequence[ToolDef]) -> list[Tool]:
    """The request's tools, each checked (its parameters a bounded JSON schema of an object,
    its name unique)."""
    tools = []
    for i, t in enumerate(defs):
        param = f"tools.{i}.function.parameters"
        schema = None if t.function.parameters is None else fields.schema_value(t.function.parameters, param)
        tools.append(fields.new_tool(t.function.name, t.function.description or "", schema, param))
    fields.unique_names(tools, "tools.{}.function.name")
    return tools


def _tool_use(body: ChatCompletionRequest) -> ToolUse | None:
    choice = body.tool_choice
    if not body.tools:
        if choice is None or choice == "none":
            return None
        raise invalid("tool_choice: only with tools", "tool_choice")
    tools = checked_tools(body.tools)
    if choice is None or isinstance(choice, str):
        return ToolUse(tuple(tools), ToolChoice(choice or "auto"), None, body.parallel_tool_calls)
    return fields.named_choice(tuple(tools), choice.function.name, "tool_choice.function.name",
                               body.parallel_tool_calls)  # fmt: skip
