"""The CEL rules of a CRD's schema (x-kubernetes-validations), evaluated on an object as the API
server does on create: defaults applied first (structural defaulting), then each rule with
`self` bound to the value at its place, for every such value the object has. Transition rules
(those reading oldSelf) apply to updates only and are not evaluated; what a rule cannot
evaluate is an error, not a pass.

    checked, errors = cel_errors(obj, schema)   # schema: one version's openAPIV3Schema
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from functools import cache
from typing import Any

import celpy  # type: ignore[import-untyped]

Obj = dict[str, Any]


def cel_errors(obj: Obj, schema: Obj) -> tuple[int, list[str]]:
    """(rules evaluated, what failed: `path: message`) for `obj` against `schema`."""
    defaulted = with_defaults(copy.deepcopy(obj), schema)
    checked, errors = 0, []
    for path, value, rule in _placed(defaulted, schema, "self"):
        if "oldSelf" in rule["rule"]:
            continue
        checked += 1
        try:
            ok = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        except Exception as exc:  # noqa: BLE001 -- a rule that cannot be evaluated is reported
            errors.append(f"{path}: cannot evaluate {rule['rule']!r}: {exc}")
            continue
        if not (isinstance(ok, celpy.celtypes.BoolType) and bool(ok)):
            errors.append(f"{path}: {rule.get('message') or rule['rule']}")
    return checked, errors


def with_defaults(value: Any, schema: Obj) -> Any:
    """Fill each absent property that has a default, in every object present (the API server's
    defaulting, before validation)."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
        for name, item in value.items():
            if name in props:
                with_defaults(item, props[name])
            elif isinstance(schema.get("additionalProperties"), dict):
                with_defaults(item, schema["additionalProperties"])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            with_defaults(item, schema["items"])
    return value


def _placed(value: Any, schema: Obj, path: str) -> Iterator[tuple[str, Any, Obj]]:
    for rule in schema.get("x-kubernetes-validations") or ():
        yield path, value, rule
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for name, item in value.items():
            extra = schema.get("additionalProperties")
            sub = props.get(name) or (extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from _placed(item, sub, f"{path}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _placed(item, schema["items"], f"{path}[{i}]")


@cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))
