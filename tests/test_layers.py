"""docs/architecture.md's import rules, checked on every module's AST (imports inside functions
included), and every file the page names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


def layer_rules(text: str) -> dict[str, frozenset[str]]:
    """The ```layers block: `package: what it may import` ('-' for nothing), one a line."""
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block is not None, "docs/architecture.md has no ```layers block"
    rules = {}
    for line in block.group(1).splitlines():
        name, _, allowed = line.partition(":")
        rules[name.strip()] = frozenset(a for a in allowed.split() if a != "-")
    return rules


def unit_of(module: str, rules: dict[str, frozenset[str]]) -> str | None:
    """The rule a module falls under: the longest rule name that is the module or a package
    above it (`cluster.edge.http_api` -> `cluster.edge`); None for what is not baton's."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in rules:
            return ".".join(parts[:n])
    return None


def crossings(unit: str, rules: dict[str, frozenset[str]], root: Path = ROOT) -> list[str]:
    """`file:line -> module` for each import in `unit` (a package, or a subpackage of one) of
    a baton module it may not import. What a rule allows is a list of modules or packages:
    `cluster.errors` allows that module, `engine` everything under engine/."""
    bad = []
    for path in sorted((root / unit.replace(".", "/")).rglob("*.py")):
        if unit_of(".".join(path.relative_to(root).with_suffix("").parts), rules) != unit:
            continue  # a subpackage with its own rule
        tree = ast.parse(path.read_text(), str(path))
        package = path.relative_to(root).parent.parts  # what a relative import counts up from
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [(alias.name, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = absolute(node, package)
                if base is None:
                    continue
                names = [(base, f"{base}.{alias.name}") for alias in node.names]
            else:
                continue
            for shown, module in names:
                target = unit_of(module, rules)
                if target is None or target == unit:
                    continue
                if not any(module == a or module.startswith(a + ".") for a in rules[unit]):
                    bad.append(f"{path.relative_to(root)}:{node.lineno} -> {shown}")
    return sorted(set(bad), key=bad.index)


def absolute(node: ast.ImportFrom, package: tuple[str, ...]) -> str | None:
    """The module a `from X import ...` names, a relative one (`from ..edge import x` in
    cluster/fleet/) resolved against the importing file's package; None if it climbs out."""
    if node.level == 0:
        return node.module
    if node.level - 1 >= len(package):
        return None
    parts = list(package[: len(package) - (node.level - 1)])
    return ".".join([*parts, node.module] if node.module else parts)


RULES = layer_rules(DOC.read_text())


def test_the_layers_cover_every_package() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    packages |= {f"cluster.{p.parent.name}" for p in ROOT.glob("cluster/*/__init__.py")}
    assert packages <= set(RULES), f"packages without a layer: {packages - set(RULES)}"
    for name, allowed in RULES.items():
        unknown = {a for a in allowed if a not in RULES and not _module_exists(a)}
        assert not unknown, f"{name} may import unknown modules {unknown}"


def _module_exists(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@pytest.mark.parametrize("unit", sorted(RULES))
def test_no_import_crosses_a_layer(unit: str) -> None:
    assert crossings(unit, RULES) == []


def test_a_crossing_is_found_and_named(tmp_path: Path) -> None:
    (tmp_path / "decode").mkdir()
    (tmp_path / "decode" / "worker.py").write_text("import engine\n\ndef f():\n    from prefill.pushes import X\n")
    assert crossings("decode", RULES, tmp_path) == ["decode/worker.py:4 -> prefill.pushes"]
    ops = tmp_path / "cluster" / "ops"
    ops.mkdir(parents=True)
    (ops / "metrics.py").write_text("from cluster.errors import EdgeError\nfrom cluster.fleet import front\n")
    assert crossings("cluster.ops", RULES, tmp_path) == ["cluster/ops/metrics.py:2 -> cluster.fleet"]
    assert crossings("cluster", RULES, tmp_path) == []  # the subpackage answers to its own rule


def test_every_file_the_page_names_exists() -> None:
    named = set(re.findall(r"`([\w./-]+/[\w.-]+\.(?:py|c|h|html|md|yaml|proto))`", DOC.read_text()))
    assert named, "the page names no files"
    assert sorted(p for p in named if not (ROOT / p).exists()) == []


# Where the environment may be touched outside engine/env.py, and why.
ENV_EXCEPTIONS = {
    "cluster/fleet/ray_runtime.py": "Ray's own RAY_* settings, set at import because Ray reads them at its import",
    "cluster/cli.py": "RAY_AUTH_MODE for a driver attaching to a token-auth cluster, before `ray` is imported",
    "cluster/devhosts.py": "the environment its dev hosts' processes inherit, RAY_* taken out",
}


def environment_uses(root: Path = ROOT) -> list[str]:
    """`file:line` of each os.environ / os.getenv / os.putenv in a serving package."""
    found = []
    for package in ("engine", "kvcache", "kvtransfer", "prefill", "decode", "cluster"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv")
                        and isinstance(node.value, ast.Name) and node.value.id == "os"):  # fmt: skip
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_environment_variables_are_read_in_one_module() -> None:
    stray = [use for use in environment_uses() if use.split(":")[0] not in {"engine/env.py", *ENV_EXCEPTIONS}]
    assert stray == [], stray


def test_a_relative_import_is_checked_like_an_absolute_one(tmp_path: Path) -> None:
    """`from ..edge import http_api` in cluster/fleet/ is cluster.edge.http_api: a crossing."""
    fleet = tmp_path / "cluster" / "fleet"
    fleet.mkdir(parents=True)
    (fleet / "x.py").write_text("from ..edge import http_api\nfrom . import front\n")
    rules = {"cluster.fleet": frozenset({"engine"}), "cluster.edge": frozenset()}
    assert crossings("cluster.fleet", rules, tmp_path) == ["cluster/fleet/x.py:1 -> cluster.edge"]
