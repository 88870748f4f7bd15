"""No module that serves, moves or stores data can unpickle (docs/architecture.md, Rules).

Every module under the serving packages is parsed (AST, not grep, so comments and strings do
not count and aliases do) and refused if it imports a pickle-family module or calls a loader
that unpickles: `torch.load` (any `weights_only`), `torch.jit.load`, `numpy.load(...,
allow_pickle=<anything but False>)`, `yaml.load` without a safe loader and yaml's unsafe and
full loaders, `pandas.read_pickle`, and dynamic imports of the banned modules. An exception
needs an entry in ALLOWED with the reason; there are none.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
# Everything that runs in a server, a worker, the CLI or a k8s hook (tests/ is not shipped).
SCANNED = ("engine", "kvcache", "cluster", "prefill", "decode", "kvtransfer", "batonpb", "bench", "k8s")
BANNED_MODULES = frozenset({"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"})
BANNED_CALLS = {
    "torch.load": "unpickles (even with weights_only, it runs the unpickler on the file)",
    "torch.serialization.load": "unpickles",
    "torch.jit.load": "a TorchScript archive holds pickles",
    "pandas.read_pickle": "unpickles",
    "yaml.unsafe_load": "constructs arbitrary Python objects",
    "yaml.unsafe_load_all": "constructs arbitrary Python objects",
    "yaml.full_load": "constructs Python objects",
    "yaml.full_load_all": "constructs Python objects",
}
SAFE_YAML_LOADERS = frozenset({"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"})
# path (relative to the repo root) -> why it may do what the checker refuses. Keep it empty.
ALLOWED: dict[str, str] = {}


@dataclass(frozen=True, slots=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


class _Checker(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}  # local name -> the dotted name it stands for
        self.constants: dict[str, tuple[str, ...]] = {}  # loop variable -> the strings it takes
        self.findings: list[Finding] = []

    def _flag(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0), what))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in BANNED_MODULES:
                self._flag(node, f"imports {alias.name}")
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                top = alias.name.split(".")[0]
                self.aliases[top] = top
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and module.split(".")[0] in BANNED_MODULES:
            self._flag(node, f"imports from {module}")
        for alias in node.names:
            full = f"{module}.{alias.name}" if module else alias.name
            if node.level == 0 and alias.name in BANNED_MODULES:
                self._flag(node, f"imports {full}")
            self.aliases[alias.asname or alias.name] = full
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        # `for name in ("a", "b"): __import__(name)` imports known names: check those
        values = _strings(node.iter)
        if isinstance(node.target, ast.Name) and values is not None:
            saved = self.constants.get(node.target.id)
            self.constants[node.target.id] = values
            self.generic_visit(node)
            if saved is None:
                del self.constants[node.target.id]
            else:
                self.constants[node.target.id] = saved
        else:
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = self._dotted(node.func)
        if name is not None:
            self._check_call(node, name)
        self.generic_visit(node)

    def _check_call(self, node: ast.Call, name: str) -> None:
        if name in BANNED_CALLS:
            self._flag(node, f"calls {name}: {BANNED_CALLS[name]}")
        elif name in ("numpy.load", "numpy.lib.npyio.load"):
            allow = _keyword(node, "allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                self._flag(node, "calls numpy.load with allow_pickle")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            loader_name = self._dotted(loader) if loader is not None else None
            if loader_name is None or loader_name.rsplit(".", 1)[-1] not in SAFE_YAML_LOADERS:
                self._flag(node, f"calls {name} without a safe Loader")
        elif name in ("__import__", "importlib.import_module") and node.args:
            target = node.args[0]
            names = _strings(target) if isinstance(target, ast.Constant) else None
            if isinstance(target, ast.Name):
                names = self.constants.get(target.id)
            if names is None:
                self._flag(node, f"{name} of a computed name (cannot be checked)")
            for module in names or ():
                if module.split(".")[0] in BANNED_MODULES:
                    self._flag(node, f"imports {module} dynamically")

    def _dotted(self, node: ast.AST) -> str | None:
        """The dotted name an expression stands for, through import aliases (`np.load` ->
        `numpy.load`); None for anything that is not a plain name or attribute chain."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))


def _keyword(node: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in node.keywords if k.arg == name), None)


def _strings(node: ast.expr) -> tuple[str, ...] | None:
    """The strings a constant string, or a literal tuple/list of them, holds; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    if isinstance(node, ast.Tuple | ast.List) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return tuple(e.value for e in node.elts if isinstance(e, ast.Constant))
    return None


def check_source(source: str, path: str) -> list[Finding]:
    checker = _Checker(path)
    checker.visit(ast.parse(source, filename=path))
    return checker.findings


def modules() -> Iterator[Path]:
    for top in SCANNED:
        yield from sorted((ROOT / top).rglob("*.py"))


def test_no_serving_module_can_unpickle() -> None:
    scanned: dict[str, int] = {}
    findings: list[Finding] = []
    for path in modules():
        rel = str(path.relative_to(ROOT))
        scanned[rel.split("/")[0]] = scanned.get(rel.split("/")[0], 0) + 1
        if rel not in ALLOWED:
            findings += check_source(path.read_text(encoding="utf-8"), rel)
    # a renamed or moved package must not make this pass by scanning nothing
    assert set(scanned) == set(SCANNED), f"nothing scanned under {set(SCANNED) - set(scanned)}"
    assert sum(scanned.values()) > 100
    assert not findings, "unpickling on a data path:\n" + "\n".join(map(str, findings))


def test_every_allowlist_entry_names_a_file_and_a_reason() -> None:
    for rel, reason in ALLOWED.items():
        assert (ROOT / rel).is_file(), f"ALLOWED names {rel}, which does not exist"
        assert len(reason.split()) >= 3, f"ALLOWED[{rel!r}] needs a reason, not {reason!r}"


OFFENDERS = '''\
import pickle
import dill as d
from cloudpickle import dumps
import marshal, os
from shelve import open as shelf
from os import path
import torch
import torch as T
from torch import load as L
import numpy as np
import yaml
import importlib
T.load("x.pt")
L("y.pt")
torch.load("z.pt", weights_only=True)
torch.jit.load("m.ts")
np.load("a.npy", allow_pickle=True)
np.load("a.npy", allow_pickle=flag)
yaml.load(text)
yaml.load(text, yaml.Loader)
yaml.load(text, Loader=yaml.FullLoader)
yaml.unsafe_load(text)
__import__("pickle")
importlib.import_module("_pickle")
importlib.import_module(name)
for mod in ("json", "marshal"):
    __import__(mod)
'''
# the lines the checker must report
EXPECTED_LINES = [1, 2, 3, 4, 5, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 27]

CLEAN = '''\
"""A docstring that says pickle, torch.load and yaml.load."""
import json
import numpy as np
import yaml
from yaml import SafeLoader
import pickletools_lookalike  # a module whose name merely starts with pickle

# pickle.loads(data) in a comment is not code
np.load("a.npy")
np.load("a.npy", allow_pickle=False)
yaml.safe_load(text)
yaml.load(text, Loader=yaml.SafeLoader)
yaml.load(text, SafeLoader)
json.loads("{}")
model.load_state_dict(state)
message = "torch.load(x)"
for lib in ("triton", "cupy"):
    __import__(lib).__version__
'''


def test_the_checker_catches_a_planted_offender(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(OFFENDERS)
    findings = check_source(planted.read_text(), "planted.py")
    assert sorted({f.line for f in findings}) == EXPECTED_LINES, "\n".join(map(str, findings))
    assert all(f.path == "planted.py" for f in findings)


def test_the_checker_passes_safe_code(tmp_path: Path) -> None:
    clean = tmp_path / "clean.py"
    clean.write_text(CLEAN)
    assert check_source(clean.read_text(), "clean.py") == []
