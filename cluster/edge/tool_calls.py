"""Tool calls: the grammar that enforces them while decoding, and the parser that reads them back.

    edge: ToolUse(tools, choice, parallel)   tools rendered by the chat template (`tools=`)
          .constraint()                      a Lark grammar (engine.constraint, kind "grammar")
    engine: every token is masked by it      a call's arguments always match its `parameters`
    edge: ToolCallParser.feed(text)          content + tool-call deltas, as the text arrives

One format, whatever the model (Hermes-style, as Qwen2.5's and Hermes' own templates write it,
and as engine/assets/chat_template.jinja renders an assistant turn's `tool_calls`):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

tool_choice, and what it becomes:

    none       no constraint and no parsing: the tools are in the prompt, the output is text
    auto       free text in which "<tool_call>" (a lazy lexeme: it ends the text the moment it
               appears) must go on as a well-formed call of one of the tools; text may come
               before a call (and, with parallel calls, between and after calls)
    required   one or more calls and nothing else (exactly one when parallel_tool_calls is false)
    function   exactly one call of the named function

So a call is never malformed unless max_tokens cuts it short (finish "length"; its arguments
are then a truncated JSON text, as with OpenAI). The JSON inside is compact, like every JSON
baton generates (engine.structured): ", " and ": " separators, no other whitespace.
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field, replace

from engine.constraint import Constraint

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = '\n{"name": "'  # after OPEN, then the name, then _ARGS
_ARGS = '", "arguments": '
_TAIL = "}\n" + CLOSE
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_NAME_CHARS = 64
# The JSON the grammar generates inside a call: compact, like engine.structured's.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A function without `parameters` takes no arguments (OpenAI's rule).
NO_ARGUMENTS = '{"type":"object","properties":{},"additionalProperties":false}'


class ToolChoice(enum.StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    FUNCTION = "function"  # the one named in ToolUse.function


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call; `parameters` is its arguments' JSON schema, as text
    already checked by engine.constraint (size, depth, patterns) and describing an object."""

    name: str
    parameters: str = NO_ARGUMENTS
    description: str = ""

    def template_value(self) -> dict[str, object]:
        """What a chat template's `tools` holds (Hugging Face's convention)."""
        function: dict[str, object] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = json.loads(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolUse:
    tools: tuple[Tool, ...]
    choice: ToolChoice = ToolChoice.AUTO
    function: str | None = None  # with ToolChoice.FUNCTION
    parallel: bool = True

    @property
    def is_parsed(self) -> bool:
        """Whether the output is read for tool calls (every choice but none)."""
        return bool(self.tools) and self.choice != ToolChoice.NONE

    def parser(self) -> ToolCallParser:
        """A parser for one choice's output (text outside calls exists only with auto)."""
        return ToolCallParser(has_text=self.choice == ToolChoice.AUTO)

    def constraint(self) -> Constraint | None:
        """The grammar that enforces this choice (None for none). Its size is bounded by
        Constraint itself (64 KiB of grammar: the tools' schemas together)."""
        if not self.is_parsed:
            return None
        tools = self.tools
        if self.choice == ToolChoice.FUNCTION:
            tools = tuple(t for t in tools if t.name == self.function)
        # call: '<tool_call>\n{"name": ' fn '}\n</tool_call>', fn_i: '"NAME", "arguments": ' ARGS
        call = f"{_lit(_HEAD[:-1])} fn {_lit(_TAIL)}"
        lines = ["fn: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        lines += [f"fn_{i}: {_lit(chr(34) + t.name + _ARGS)} %json {_styled(t.parameters)}" for i, t in enumerate(tools)]
        if self.choice == ToolChoice.AUTO:
            start = "start: call* TEXT" if self.parallel else "start: call | TEXT"
            head = ["%llguidance {}", start, f"call: trigger {call}",
                    f"trigger[lazy]: TEXT {_lit(OPEN)}", r"TEXT: /(.|\n)*/"]
        else:
            multiple = self.parallel and self.choice == ToolChoice.REQUIRED
            head = ['start: call ("\\n" call)*' if multiple else "start: call", f"call: {_lit(OPEN)} {call}"]
        return Constraint("grammar", "\n".join(head + lines))


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _styled(parameters: str) -> str:
    """The arguments' schema, compact JSON enforced (a client's own x-guidance is dropped)."""
    schema = json.loads(parameters)
    schema.pop("x-guidance", None)
    schema.setdefault("type", "object")
    schema["x-guidance"] = _JSON_STYLE
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


# -- reading calls back ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of one call, OpenAI's streaming shape: the first carries id and name."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, object]:
        out: dict[str, object] = {"index": self.index}
        function: dict[str, str] = {"arguments": self.arguments}
        if self.id is not None:
            out.update(id=self.id, type="function")
        if self.name is not None:
            function = {"name": self.name, **function}
        out["function"] = function
        return out


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, exactly as generated

    def to_openai(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class Parsed:
    """What one feed produced: content text and call deltas."""

    content: list[str] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.content)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class _State(enum.IntEnum):
    TEXT = 0
    HEAD = 1  # after OPEN: '\n{"name": "NAME", "arguments": '
    ARGS = 2  # the arguments' JSON object
    TAIL = 3  # '}\n</tool_call>'


@dataclass(slots=True)
class ToolCallParser:
    """Splits one choice's output into content and tool calls as the text arrives.

    Streaming and non-streaming responses both run it (the latter on the whole text), so they
    agree. Text that might still become OPEN is held back; so is trailing whitespace, which is
    dropped around calls (the grammar's separators) and kept when there are none. Without
    `has_text` (required, a named function) everything outside calls is markup: "\n" between
    calls, or a call that max_tokens cut before its name."""

    has_text: bool = True
    state: _State = _State.TEXT
    buf: str = ""  # TEXT: held text; HEAD/TAIL: what was matched so far
    held_space: str = ""
    after_call: bool = False  # leading whitespace of the text after a call is the grammar's
    depth: int = 0  # ARGS: braces and brackets open
    in_string: bool = False
    escaped: bool = False
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        i = 0
        while i < len(text):
            if self.state == _State.TEXT:
                i = self._text(text, i, out)
            elif self.state == _State.HEAD:
                i = self._head(text, i, out)
            elif self.state == _State.ARGS:
                i = self._args(text, i, out)
            else:
                i = self._tail(text, i)
        return out

    def finish(self) -> Parsed:
        """The end of the output: held text is content. A call cut short by max_tokens before
        its name is complete is dropped (markup, not content); after, it is a call whose
        arguments are truncated."""
        out = Parsed()
        if self.state == _State.TEXT:
            self._content(self.buf, out)
        self.buf = ""
        if not self.calls and self.held_space:
            out.content.append(self.held_space)
        self.held_space = ""
        return out

    def _text(self, text: str, i: int, out: Parsed) -> int:
        self.buf += text[i:]
        at = self.buf.find(OPEN)
        if at >= 0:
            rest = self.buf[at + len(OPEN):]
            self._content(self.buf[:at], out)
            self.buf, self.state = "", _State.HEAD
            return len(text) - len(rest)
        keep = _partial_suffix(self.buf, OPEN)
        self._content(self.buf[: len(self.buf) - keep], out)
        self.buf = self.buf[len(self.buf) - keep:]
        return len(text)

    def _content(self, text: str, out: Parsed) -> None:
        if not self.has_text:
            return
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        stripped = text.rstrip()
        if stripped:
            out.content.append(self.held_space + stripped)
            self.held_space = ""
        self.held_space += text[len(stripped):]

    def _head(self, text: str, i: int, out: Parsed) -> int:
        """Match '\\n{"name": "NAME", "arguments": ' one character at a time."""
        while i < len(text):
            self.buf += text[i]
            i += 1
            name = _match_head(self.buf)
            if name is False:  # not a call after all (only possible without the grammar): text
                self.state, held = _State.TEXT, self.buf
                self.buf = ""
                self._content(OPEN + held, out)
                return i
            if isinstance(name, str):
                call = ToolCall(new_call_id(), name)
                self.calls.append(call)
                self.held_space = ""  # whitespace around calls belongs to no one
                out.calls.append(ToolCallDelta(len(self.calls) - 1, call.id, name, ""))
                self.buf, self.state = "", _State.ARGS
                self.depth, self.in_string, self.escaped = 0, False, False
                return i
        return i

    def _args(self, text: str, i: int, out: Parsed) -> int:
        start = i
        while i < len(text):
            char = text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.state, self.buf = _State.TAIL, ""
                    break
        piece = text[start:i]
        if piece:
            index = len(self.calls) - 1
            self.calls[index].arguments += piece
            last = out.calls[-1] if out.calls else None
            if last is not None and last.index == index:  # one delta per call and feed
                out.calls[-1] = replace(last, arguments=last.arguments + piece)
            else:
                out.calls.append(ToolCallDelta(index, None, None, piece))
        return i

    def _tail(self, text: str, i: int) -> int:
        while i < len(text):
            self.buf += text[i]
            i += 1
            if self.buf == _TAIL or not _TAIL.startswith(self.buf):  # a mismatch: only without the grammar
                self.state, self.buf, self.after_call = _State.TEXT, "", True
                return i
        return i


def _match_head(buf: str) -> str | bool | None:
    """The function's name once `buf` is a whole call head; None while it may still become
    one; False when it cannot."""
    fixed = len(_HEAD)
    if len(buf) <= fixed:
        return None if _HEAD.startswith(buf) else False
    name, quote, after = buf[fixed:].partition('"')
    if len(name) > MAX_NAME_CHARS or not set(name) <= _NAME_CHARS:
        return False
    if not quote:
        return None
    if quote + after == _ARGS and name:
        return name
    return None if _ARGS.startswith(quote + after) else False


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def finish_reason(reason: str | None, parser: ToolCallParser | None) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the output ended normally after a call."""
    if reason == "stop" and parser is not None and parser.calls:
        return "tool_calls"
    return reason
