"""A request's output constraint: what the text must match, bounded before anything compiles.

    Constraint("json_object")                      any JSON object
    Constraint("json_schema", '{"type": ...}')     JSON valid under the schema (draft 2020-12 subset)
    Constraint("regex", r"\\d{3}-\\d{4}")            text the regex matches in full
    Constraint("grammar", 'start: "a" /[0-9]+/')   text the Lark grammar derives (llguidance's Lark)

The spec is a frozen, hashable value inside `SamplingParams`, built at the edge from client
fields, and — like every other sampling field — checked in its constructor, in pure Python and
in time linear in its size, before any grammar is compiled (docs/architecture.md, Rules):

- size: a schema or grammar of at most 64 KiB, a regex of at most 2,000 characters;
- nesting: a schema's JSON document at most 64 containers deep (scanned before it is parsed, so
  a 1,000-deep schema costs one regex pass, not a recursion);
- regex complexity (the regex itself, every schema `pattern` / `patternProperties` key, every
  `/.../` terminal of a grammar): at most 32 nested groups, counted repetitions of at most
  1,000, and at most 5,000 positions once counted repetitions are expanded, so `a{100000}` and
  `(x{1,100}){1,100}` are refused here rather than met by the matcher mid-request.

What passes is compiled later by the engine (engine.structured), under the matcher library's
own resource limits and a wall-clock bound. Every refusal is a `ConstraintError`, a
`SamplingError` on the field `constraint`: the edge turns it into 400 / INVALID_ARGUMENT.

A JSON schema's text is normalised (parsed and re-serialised compactly, key order kept) so that
equal schemas share one compiled grammar whatever their whitespace.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

from engine.errors import BatonError

MAX_SCHEMA_BYTES = 64 * 1024
MAX_GRAMMAR_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 64  # JSON containers; one nested object level is about two
MAX_REGEX_CHARS = 2_000
MAX_REGEX_GROUP_DEPTH = 32
MAX_REGEX_REPEAT = 1_000  # the largest bound of one counted repetition {m,n}
MAX_REGEX_POSITIONS = 5_000  # the regex's size with counted repetitions expanded

_FIELD = "constraint"
# Keys whose values are data, not subschemas: a "pattern" inside an enum value is not a regex.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


class ConstraintError(BatonError, ValueError):
    """A constraint is malformed, too large or too complex, or does not compile.

    The same shape as `engine.sampling.SamplingError` (`field` names the request field), which
    the edge maps to 400 / INVALID_ARGUMENT like every BatonError."""

    def __init__(self, message: str, field: str = _FIELD) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message  # without the field's name: an edge names its own request field


class ConstraintKind(enum.StrEnum):
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    GRAMMAR = "grammar"  # Lark syntax, as llguidance reads it


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match; `text` is empty for json_object."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in ConstraintKind._value2member_map_:
            kinds = ", ".join(k.value for k in ConstraintKind)
            raise ConstraintError(f"kind must be one of {kinds}, got {self.kind!r}")
        kind = ConstraintKind(self.kind)
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.text, str):
            raise ConstraintError(f"the {kind.value} must be given as a string")
        if kind == ConstraintKind.JSON_OBJECT:
            if self.text:
                raise ConstraintError("json_object takes no text (use json_schema for a schema)")
        elif kind == ConstraintKind.JSON_SCHEMA:
            object.__setattr__(self, "text", _checked_schema(self.text))
        elif kind == ConstraintKind.REGEX:
            check_regex(self.text, "the regex")
        else:
            _check_grammar(self.text)


# -- JSON schemas ---------------------------------------------------------------------------------

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """How deep the containers of a JSON text nest, without parsing it (strings skipped)."""
    depth = deepest = 0
    for match in _JSON_BRACKET.finditer(_JSON_STRING.sub('""', text)):
        depth += 1 if match.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _checked_schema(text: str) -> str:
    """The schema's normalised text, once its size, depth and regexes are within bounds."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise ConstraintError(f"the JSON schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are allowed")
    depth = json_depth(text)
    if depth > MAX_SCHEMA_DEPTH:
        raise ConstraintError(f"the JSON schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed")
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ConstraintError("the JSON schema must be a JSON object")
    for where, pattern in _schema_patterns(schema):
        check_regex(pattern, where)
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _schema_patterns(node: object, path: str = "#") -> Iterator[tuple[str, str]]:
    """(where, regex) for every `pattern` and `patternProperties` key of a schema document.

    Recursion is bounded: the document was checked to nest at most MAX_SCHEMA_DEPTH deep."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            yield from _schema_patterns(item, f"{path}/{i}")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        where = f"{path}/{key}"
        if key == "pattern" and isinstance(value, str):
            yield f"the pattern at {where}", value
        elif key == "patternProperties" and isinstance(value, dict):
            for pattern in value:
                yield f"the patternProperties key at {where}", pattern
        if key not in _DATA_KEYS:
            yield from _schema_patterns(value, where)


# -- regexes --------------------------------------------------------------------------------------

_COUNTED = re.compile(r"\{(\d*)(,(\d*))?\}")


@dataclass(slots=True)
class _Group:
    """A group being scanned: positions of its finished alternatives, its current sequence,
    and its last atom (the one a quantifier applies to)."""

    alternatives: int = 0
    sequence: int = 0
    last: int = 0

    @property
    def total(self) -> int:
        return self.alternatives + self.sequence


def check_regex(pattern: str, where: str) -> None:
    """Refuse a regex that is too long, nests too deep or expands too far (see the module doc).

    A linear scan of the syntax regex engines share (Rust's, which llguidance uses, and
    Python's); what it does not understand it counts as one position and leaves to the
    compiler, which reports syntax errors itself."""
    if not isinstance(pattern, str):
        raise ConstraintError(f"{where} must be a string")
    if len(pattern) > MAX_REGEX_CHARS:
        raise ConstraintError(f"{where} has {len(pattern)} characters; at most {MAX_REGEX_CHARS} are allowed")
    stack = [_Group()]
    i = 0
    while i < len(pattern):
        char, top = pattern[i], stack[-1]
        if char == "(":
            i = _open_group(pattern, i, stack, where)
            continue
        if char == ")" and len(stack) > 1:
            stack.pop()
            _atom(stack[-1], top.total)
        elif char == "|":
            top.alternatives += top.sequence
            top.sequence = top.last = 0
        elif char == "{" and (counted := _COUNTED.match(pattern, i)) is not None:
            times = _repeat_times(counted, where)
            top.sequence += top.last * (times - 1)
            top.last *= times
            i = counted.end()
            _check_positions(stack, where)
            continue
        elif char in "*+?":
            pass  # a star does not multiply positions
        else:
            i = _skip_atom(pattern, i)
            _atom(top, 1)
            _check_positions(stack, where)
            continue
        i += 1
    _check_positions(stack, where)


def _atom(group: _Group, positions: int) -> None:
    group.sequence += positions
    group.last = positions


def _open_group(pattern: str, i: int, stack: list[_Group], where: str) -> int:
    """Scan past "(" (and a "(?flags:" / "(?P<name>" prefix); a bare "(?i)" opens nothing."""
    j = i + 1
    if pattern.startswith("?", j):
        while j < len(pattern) and pattern[j] not in ":)>":
            j += 1
        if j < len(pattern) and pattern[j] == ")":
            return j + 1
        j += 1
    if len(stack) >= MAX_REGEX_GROUP_DEPTH:
        raise ConstraintError(f"{where} nests groups more than {MAX_REGEX_GROUP_DEPTH} deep")
    stack.append(_Group())
    return j


def _skip_atom(pattern: str, i: int) -> int:
    """The index after the atom at i: a character, an escape (\\p{..} whole) or a class."""
    if pattern[i] == "\\":
        if pattern.startswith(("p{", "P{", "x{", "u{"), i + 1):
            end = pattern.find("}", i)
            return len(pattern) if end < 0 else end + 1
        return i + 2
    if pattern[i] != "[":
        return i + 1
    depth, j = 1, _class_body(pattern, i + 1)
    while j < len(pattern):  # classes nest in Rust's syntax: [a-z&&[^aeiou]]
        c = pattern[j]
        if c == "\\":
            j += 2
        elif c == "[":
            depth, j = depth + 1, _class_body(pattern, j + 1)
        elif c == "]" and (depth := depth - 1) == 0:
            return j + 1
        else:
            j += 1
    return j


def _class_body(pattern: str, j: int) -> int:
    """Skip a class's leading "^" and a "]" right after it (a literal there)."""
    j += pattern.startswith("^", j)
    return j + pattern.startswith("]", j)


def _repeat_times(counted: re.Match[str], where: str) -> int:
    lo_text, hi_text = counted.group(1), counted.group(3)
    if not lo_text and not hi_text:
        raise ConstraintError(f"{where} has an empty repetition {counted.group()}")
    lo = int(lo_text or "0")
    hi = int(hi_text) if hi_text else None
    largest = max(lo, hi or 0)
    if largest > MAX_REGEX_REPEAT:
        raise ConstraintError(
            f"{where} repeats {counted.group()}; a counted repetition may go up to {MAX_REGEX_REPEAT}"
        )
    # {m,} is m copies and a star: m + 1 positions' worth.
    return max(hi if hi is not None else lo + (counted.group(2) is not None), 1)


def _check_positions(stack: list[_Group], where: str) -> None:
    # Enclosing groups only add to these positions (repetitions of a group are applied when it
    # closes), so the running sum is a lower bound of the final size: refusing early is exact.
    if sum(g.total for g in stack) > MAX_REGEX_POSITIONS:
        raise ConstraintError(
            f"{where} is too complex: it expands to more than {MAX_REGEX_POSITIONS} positions"
        )


# -- grammars -------------------------------------------------------------------------------------


def _check_grammar(text: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise ConstraintError(f"the grammar is {size} bytes; at most {MAX_GRAMMAR_BYTES} are allowed")
    if not text.strip():
        raise ConstraintError("the grammar is empty")
    for n, regex in enumerate(_lark_regexes(text), 1):
        check_regex(regex, f"regex terminal {n} of the grammar")


def _lark_regexes(text: str) -> Iterator[str]:
    """The /.../ terminals of a Lark grammar (strings and // comments skipped)."""
    i = 0
    while i < len(text):
        char = text[i]
        if char == '"':
            i = _skip_quoted(text, i, '"')
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        elif char == "/":
            end = _skip_quoted(text, i, "/")
            yield text[i + 1 : end - 1]
            i = end
        else:
            i += 1


def _skip_quoted(text: str, i: int, quote: str) -> int:
    """The index after the literal opened by `quote` at i (escapes honoured; to the end when
    it is never closed)."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == quote:
            return j + 1
        else:
            j += 1
    return len(text)
