"""Closing a prefix of compact JSON: how the tests check that a constrained output cut by
max_tokens is still on its way to a JSON object (an independent check: a tiny state machine over
the characters, not the grammar library the engine uses)."""

from __future__ import annotations

import re


def close_json(prefix: str) -> str:
    """The shortest text that closes a prefix of compact JSON; ValueError for text that is not
    one (a closing bracket or a separator outside any container), so a test shows the text."""
    stack: list[str] = []  # "{" or "[" per open container
    expect_key: list[bool] = []  # per open object: the next string is a key
    in_string = escape = False
    unicode_left = 0
    for char in prefix:
        if in_string:
            if unicode_left:
                unicode_left -= 1
            elif escape:
                escape, unicode_left = False, 4 if char == "u" else 0
            elif char == "\\":
                escape = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            stack.append(char)
            expect_key.append(char == "{")
        elif char in "}]":
            if not stack or stack.pop() != "{["[char == "]"]:
                raise ValueError(f"not a prefix of JSON: {prefix!r}")
            expect_key.pop()
        elif char in ":," and not stack:
            raise ValueError(f"not a prefix of JSON: {prefix!r}")
        elif char == ":":
            expect_key[-1] = False
        elif char == "," and stack[-1] == "{":
            expect_key[-1] = True
    tail = ""
    if in_string:
        tail += "0" * unicode_left + ("n" if escape else "") + '"'
    body = (prefix + tail).rstrip()
    if body.endswith('"') and stack and stack[-1] == "{" and expect_key[-1]:
        tail += ": 0"  # a key without its value
    elif body.endswith(":"):
        tail += " 0"
    elif body.endswith(","):
        tail += ' "k": 0' if stack[-1] == "{" else " 0"
    elif re.search(r"[-+.eE]$", body):
        tail += "0"
    elif m := re.search(r"\b(t|tr|tru|f|fa|fal|fals|n|nu|nul)$", body):
        tail += {"t": "rue", "f": "alse", "n": "ull"}[m.group(1)[0]][len(m.group(1)) - 1 :]
    return prefix + tail + "".join("}" if c == "{" else "]" for c in reversed(stack))
