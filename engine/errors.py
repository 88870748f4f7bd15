"""Errors a user can cause by pointing baton at a model or sending it a request.

Each carries a message meant for the user: it names the file or field at fault and never
needs a traceback to be understood.
"""

from __future__ import annotations


class BatonError(Exception):
    """Base class for errors whose message is meant for the user."""


class ConfigError(BatonError):
    """A model config.json (or a baton config) is malformed; `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UnsupportedModelError(BatonError):
    """The checkpoint is well-formed but describes a model baton does not run."""


class CheckpointError(BatonError):
    """The checkpoint directory cannot be loaded safely (missing, pickle-only, corrupt)."""


class RequestError(BatonError):
    """A request the engine cannot accept (too long, empty, bad token ids); `field` names why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class SlowReaderError(BatonError):
    """A consumer fell so far behind that its buffered output passed the bound: cancelled."""
