"""Client fields -> the engine's output constraint, each refusal a 400 / INVALID_ARGUMENT that
names the field (the HTTP and gRPC edges both build their constraints here).

`OutputSpec` is what a request asks of its output: the constraint (at most one), the field it
came from (Frontend.prepare_constraint names it when the compile fails), and the tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cluster.edge.tool_calls import NO_ARGUMENTS, Tool, ToolChoice, ToolUse
from cluster.errors import invalid
from engine.constraint import MAX_SCHEMA_DEPTH, Constraint, ConstraintError


@dataclass(frozen=True, slots=True)
class OutputSpec:
    constraint: Constraint | None = None
    param: str | None = None  # the request field the constraint came from
    tools: ToolUse | None = None  # set whenever the request lists tools

    @property
    def parses_tools(self) -> bool:
        return self.tools is not None and self.tools.is_parsed


def checked(kind: str, text: str, param: str) -> Constraint:
    """Constraint(kind, text), its bounds checked (engine.constraint), refusals naming `param`."""
    try:
        return Constraint(kind, text)
    except ConstraintError as exc:
        raise invalid(f"{param}: {exc.reason}", param) from None


def schema_value(schema: dict[str, Any], param: str) -> Constraint:
    """A JSON schema already parsed (an HTTP body): its depth is bounded before it is
    serialised again."""
    if _nests_deeper(schema, MAX_SCHEMA_DEPTH):
        raise invalid(f"{param}: the JSON schema nests more than {MAX_SCHEMA_DEPTH} levels deep", param)
    return checked("json_schema", json.dumps(schema, ensure_ascii=False), param)


def new_tool(name: str, description: str, parameters: Constraint | None, param: str) -> Tool:
    """A tool from checked fields; `param` names its parameters field."""
    text = NO_ARGUMENTS if parameters is None else parameters.text
    if json.loads(text).get("type", "object") != "object":  # bounded: checked by Constraint
        raise invalid(f"{param}: must describe a JSON object (type object)", param)
    return Tool(name, text, description)


def unique_names(tools: list[Tool], name_param: str) -> None:
    """`name_param` has one "{}" for the index of the tool that repeats a name."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            field = name_param.format(i)
            raise invalid(f"{field}: {tool.name!r} is defined twice", field)
        seen.add(tool.name)


def with_tools(found: list[tuple[str, Constraint]], tools: ToolUse | None) -> OutputSpec:
    """The request's spec from the constraints its fields gave (at most one may be given, and
    none beside tool calls)."""
    if tools is not None and tools.is_parsed:
        if found:
            first = found[0][0]
            raise invalid(f"{first}: cannot be combined with tool calls (unless tool_choice is none)", first)
        try:
            constraint = tools.constraint()
        except ConstraintError as exc:
            raise invalid(f"tools: {exc.reason}", "tools") from None
        assert constraint is not None  # is_parsed
        found = [("tools", constraint)]
    if len(found) > 1:
        second = found[1][0]
        raise invalid(f"{second}: only one output constraint may be given (also set: {found[0][0]})", second)
    if not found:
        return OutputSpec(tools=tools)
    return OutputSpec(found[0][1], found[0][0], tools)


def named_choice(tools: tuple[Tool, ...], name: str, param: str, parallel: bool) -> ToolUse:
    if all(t.name != name for t in tools):
        raise invalid(f"{param}: no tool is named {name!r}", param)
    return ToolUse(tools, ToolChoice.FUNCTION, name, parallel)


def parse_arguments(text: str, param: str) -> Any:
    """An earlier tool call's arguments (JSON text), parsed for the chat template."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise invalid(f"{param}: not valid JSON", param) from None


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether JSON containers nest more than `limit` deep (iterative: no recursion limit)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
