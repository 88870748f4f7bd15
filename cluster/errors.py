"""Errors of the serving edge, each mapped once to an HTTP status and a gRPC code.

Engine-side refusals (RequestError, SamplingError, ConfigError) are "invalid argument" too;
`classify` turns any exception into the one EdgeError the two APIs render.
"""

from __future__ import annotations

import enum

from engine.errors import BatonError, SlowReaderError


class Kind(enum.IntEnum):
    INVALID_ARGUMENT = 0
    UNAUTHENTICATED = 1
    NOT_FOUND = 2
    RESOURCE_EXHAUSTED = 3
    DEADLINE_EXCEEDED = 4
    UNAVAILABLE = 5
    CANCELLED = 6
    INTERNAL = 7
    PERMISSION_DENIED = 8
    ABORTED = 9  # conflicts with what the server is doing (a scale under way, the planner's counts)

    @property
    def http_status(self) -> int:
        return (400, 401, 404, 429, 408, 503, 499, 500, 403, 409)[self]

    @property
    def openai_type(self) -> str:
        return (
            "invalid_request_error", "authentication_error", "invalid_request_error",
            "rate_limit_exceeded", "timeout", "service_unavailable", "cancelled", "internal_error",
            "permission_error", "conflict_error",
        )[self]


class EdgeError(Exception):
    """An error with a user-facing message; `param` names the offending request field."""

    def __init__(
        self, kind: Kind, message: str, param: str | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def openai_body(self) -> dict[str, dict[str, str | None]]:
        """The OpenAI-shaped error body both the edge and the gateway's proxy answer with."""
        return {"error": {"message": self.message, "type": self.kind.openai_type, "param": self.param,
                          "code": self.kind.name.lower()}}  # fmt: skip


def invalid(message: str, param: str | None = None) -> EdgeError:
    return EdgeError(Kind.INVALID_ARGUMENT, message, param)


def classify(exc: BaseException) -> EdgeError:
    """The EdgeError for any exception; internals never leak into the message."""
    if isinstance(exc, EdgeError):
        return exc
    if isinstance(exc, SlowReaderError):
        return EdgeError(Kind.CANCELLED, str(exc))
    if isinstance(exc, BatonError):
        field = getattr(exc, "field", None)
        return EdgeError(Kind.INVALID_ARGUMENT, str(exc), field if isinstance(field, str) else None)
    if isinstance(exc, TimeoutError):
        return EdgeError(Kind.DEADLINE_EXCEEDED, "the request's deadline passed")
    return EdgeError(Kind.INTERNAL, "internal error")
