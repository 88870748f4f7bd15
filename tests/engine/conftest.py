"""Shared fixtures for the engine tests: a private cache directory and the baton-tiny model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.builtin import resolve_model_dir

# transformers is only the parity reference here: it must never reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def baton_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point BATON_CACHE_DIR at a fresh directory, so tests neither read nor fill the
    developer's cache."""
    path = tmp_path_factory.mktemp("baton-cache")
    previous = os.environ.get("BATON_CACHE_DIR")
    os.environ["BATON_CACHE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("BATON_CACHE_DIR", None)
    else:
        os.environ["BATON_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def tiny_model_dir(baton_cache_dir: Path) -> Path:
    """baton-tiny, created once per session in the test cache (the built-in path)."""
    path = resolve_model_dir("baton-tiny")
    assert path.is_relative_to(baton_cache_dir)
    return path
