"""Reading the built k8s/ manifests: kustomize builds, pod templates, CRD schemas, PromQL names.

Everything here is offline: `kubectl kustomize` needs no API server, the CRD schemas are copies
in tests/k8s/crds/ (with their SOURCE), and docs/metrics.md is the metric names' one list.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CRDS = Path(__file__).resolve().parent / "crds"
METRICS_DOC = ROOT / "docs" / "metrics.md"
TARGETS = ("base", "overlays/cpu", "overlays/gpu")
OVERLAYS = ("overlays/cpu", "overlays/gpu")
COMPONENTS = ("model-fetch", "gcs-ft", "kv-disk-shared", "etcd-tls")  # k8s/overlays/gpu/optional/
NAMESPACE = "baton"
KUSTOMIZE_TIMEOUT_S = 60

Obj = dict[str, Any]


def yaml_docs(text: str) -> list[Any]:
    """Every document in `text`, safely (libyaml's loader when PyYAML has it: the CRDs are large)."""
    if hasattr(yaml, "CSafeLoader"):
        return list(yaml.load_all(text, Loader=yaml.CSafeLoader))
    return list(yaml.safe_load_all(text))


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise RuntimeError(
            "kubectl is not on PATH: the k8s tests build the manifests with `kubectl kustomize`"
        )
    return path


def kustomize(directory: Path) -> list[Obj]:
    """The objects `kubectl kustomize DIR` renders (raises with kustomize's message on failure)."""
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True,
                         timeout=KUSTOMIZE_TIMEOUT_S, check=False)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory} failed:\n{out.stderr.strip()}")
    return [d for d in yaml_docs(out.stdout) if d]


def build(target: str) -> list[Obj]:
    return kustomize(K8S / target)


def build_gpu_with(component: str) -> list[Obj]:
    """The gpu overlay with one optional component on, enabled the way its kustomization.yaml
    says to: a copy of k8s/ whose overlay has `# components:` and `# - optional/<component>`
    uncommented (kustomize applies components before the overlay's own patches: wrapping the
    overlay in another kustomization would hide a conflict between the two), and so are the
    lines of its cluster.yaml marked `# optional/<component>`."""
    with tempfile.TemporaryDirectory(prefix="baton-k8s-") as tmp:
        copy = Path(tmp) / "k8s"
        shutil.copytree(K8S, copy)
        overlay = copy / "overlays" / "gpu" / "kustomization.yaml"
        overlay.write_text(enable_component(overlay.read_text(), component))
        config = overlay.parent / "cluster.yaml"
        config.write_text(enable_config_lines(config.read_text(), component))
        return kustomize(overlay.parent)


def enable_config_lines(cluster_yaml: str, component: str) -> str:
    """`cluster_yaml` with each commented line that ends in `# optional/<component>` uncommented."""
    marker = f"# optional/{component}"
    lines = []
    for line in cluster_yaml.splitlines(keepends=True):
        body = line.lstrip(" ")
        if body.startswith("# ") and line.rstrip("\n").endswith(marker):
            line = line[: len(line) - len(body)] + body[2:]
        lines.append(line)
    return "".join(lines)


def enable_component(kustomization: str, component: str) -> str:
    """`kustomization` with the component's documented lines uncommented; ValueError if they
    are not there to uncomment."""
    lines = kustomization.splitlines(keepends=True)
    wanted = {"# components:": "components:", f"# - optional/{component}": f"- optional/{component}"}
    found = set()
    for i, line in enumerate(lines):
        key = line.rstrip("\n")
        if key in wanted:
            lines[i] = line.replace(key, wanted[key])
            found.add(key)
    if found != set(wanted):
        raise ValueError(f"the overlay does not say how to enable {component}: missing {sorted(set(wanted) - found)}")
    return "".join(lines)


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


@dataclass(frozen=True, slots=True)
class PodTemplate:
    """One pod template in a build: where it is and what it says."""

    owner: str  # "RayCluster/baton head", "RayCluster/baton prefill", "StatefulSet/baton-etcd"
    group: str  # head, prefill, decode, or the workload's name
    labels: dict[str, str]
    spec: Obj

    def containers(self, init: bool = True) -> list[Obj]:
        return list(self.spec.get("containers", [])) + (
            list(self.spec.get("initContainers", [])) if init else []
        )

    def container(self, name: str) -> Obj:
        found = [c for c in self.containers() if c["name"] == name]
        assert len(found) == 1, f"{self.owner}: no container {name}"
        return found[0]

    def volume(self, name: str) -> Obj:
        found: list[Obj] = [v for v in self.spec.get("volumes", []) if v["name"] == name]
        assert len(found) == 1, f"{self.owner}: no volume {name}"
        return found[0]


def pod_templates(objects: list[Obj]) -> Iterator[PodTemplate]:
    for o in objects:
        kind, name = o["kind"], o["metadata"]["name"]
        if kind == "RayCluster":
            head = o["spec"]["headGroupSpec"]["template"]
            yield PodTemplate(
                f"RayCluster/{name} head", "head", head["metadata"].get("labels", {}), head["spec"]
            )
            for group in o["spec"].get("workerGroupSpecs", []):
                t = group["template"]
                yield PodTemplate(f"RayCluster/{name} {group['groupName']}", group["groupName"],
                                  t["metadata"].get("labels", {}), t["spec"])  # fmt: skip
        elif kind in ("StatefulSet", "Deployment", "DaemonSet", "Job"):
            t = o["spec"]["template"]
            yield PodTemplate(f"{kind}/{name}", name, t["metadata"].get("labels", {}), t["spec"])


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels + matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]  # fmt: skip
        if not ok:
            return False
    return True


def ray_cluster(objects: list[Obj]) -> Obj:
    return one(objects, "RayCluster", "baton")


def worker_group(objects: list[Obj], name: str) -> Obj:
    groups: list[Obj] = [
        g for g in ray_cluster(objects)["spec"]["workerGroupSpecs"] if g["groupName"] == name
    ]
    assert len(groups) == 1, f"no worker group {name}"
    return groups[0]


def template(objects: list[Obj], group: str) -> PodTemplate:
    found = [t for t in pod_templates(objects) if t.group == group]
    assert len(found) == 1, f"no pod template {group}"
    return found[0]


def cluster_file(objects: list[Obj]) -> Any:  # -> cluster.cluster_config.ClusterFile
    """The build's cluster.yaml (ConfigMap baton-config), parsed by baton's own schema."""
    from cluster.cluster_config import parse_cluster_file

    text = one(objects, "ConfigMap", "baton-config")["data"]["cluster.yaml"]
    return parse_cluster_file(text, "ConfigMap baton-config")


def ray_resources(ray_start_params: dict[str, str]) -> dict[str, float]:
    """The custom resources a group declares: rayStartParams.resources, a JSON map that KubeRay
    pastes into a bash command line (so it is quoted) and parses after trimming the quotes."""
    raw = ray_start_params.get("resources")
    if raw is None:
        return {}
    assert raw.startswith("'") and raw.endswith("'"), (
        f"resources {raw!r}: quote the JSON map in single quotes"
    )
    parsed = json.loads(raw.strip("'\"` "))
    assert isinstance(parsed, dict)
    return {str(k): float(v) for k, v in parsed.items()}


# --- CRD schemas ------------------------------------------------------------------------------


def crd_schema(path: Path, version: str) -> Obj:
    """The openAPIV3Schema of one version of a CRD, made strict: an object with listed
    properties accepts no others (as the API server's strict field validation, instead of
    silently pruning a misspelt field)."""
    (crd,) = yaml_docs(path.read_text())
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema: Obj = _strict(v["schema"]["openAPIV3Schema"])
            return schema
    raise KeyError(f"{path.name}: no version {version}")


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


# --- metric names -----------------------------------------------------------------------------

_BACKTICKED = re.compile(r"`([^`]+)`")
_METRIC = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def documented_metrics(doc: Path = METRICS_DOC) -> set[str]:
    """Metric names in the first column of docs/metrics.md's tables (backticked, labels in
    braces after the name are dropped)."""
    names: set[str] = set()
    for line in doc.read_text(encoding="utf-8").splitlines():
        cells = line.strip().split("|")
        if len(cells) < 3 or not line.strip().startswith("|"):
            continue
        for span in _BACKTICKED.findall(cells[1]):
            name = span.split("{", 1)[0].strip()
            if _METRIC.match(name):
                names.add(name)
    return names


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan", "atan2"}  # fmt: skip
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a small lexer, enough for dashboards and
    rules: strings, label matchers, ranges, grouping labels and functions are not names)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', " ", expr)  # strings
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers (and template variables in them)
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries, $__rate_interval
    s = _GROUPING.sub(" ", s)
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # remaining template variables
    names = set()
    for m in _IDENT.finditer(s):
        word = m.group(0)
        rest = s[m.end() :].lstrip()
        if word.lower() in _KEYWORDS or rest.startswith("("):
            continue  # a keyword, or a function / aggregation
        if re.fullmatch(r"\d+[smhdwy]", word) or (m.start() > 0 and s[m.start() - 1].isdigit()):
            continue  # a duration or the exponent of a number
        names.add(word)
    return names


def base_metric(name: str, documented: set[str]) -> str:
    """A histogram's series (_bucket, _sum, _count) under the family name the table lists."""
    if name in documented:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in documented:
            return name[: -len(suffix)]
    return name


def dashboard_exprs(dashboard: Obj) -> list[tuple[str, str]]:
    """(panel title, expr) for every PromQL target of a Grafana dashboard, rows included."""
    out: list[tuple[str, str]] = []

    def walk(panels: list[Obj]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                if "expr" in t:
                    out.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        q = var.get("query")
        query = q.get("query") if isinstance(q, dict) else q
        if var.get("type") == "query" and isinstance(query, str):
            m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\)\s*", query)
            out.append((f"variable {var['name']}", m.group(1) if m else query))
    return out
