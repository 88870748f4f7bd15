"""Each kustomize target is built once per session (`kubectl kustomize`, offline)."""

from __future__ import annotations

import pytest

from tests.k8s.manifests import COMPONENTS, TARGETS, Obj, build, build_gpu_with


@pytest.fixture(scope="session")
def builds() -> dict[str, list[Obj]]:
    """base, overlays/cpu and overlays/gpu, rendered."""
    return {target: build(target) for target in TARGETS}


@pytest.fixture(scope="session")
def component_builds() -> dict[str, list[Obj]]:
    """The gpu overlay with each optional component (k8s/overlays/gpu/optional/) on."""
    return {c: build_gpu_with(c) for c in COMPONENTS}
