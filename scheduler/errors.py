"""Errors the scheduling core raises; each names the gRPC status code it crosses the boundary as.

The core stays free of grpc so the gateway can run it in-process; the service maps `code`
to `grpc.StatusCode` by name.
"""

from __future__ import annotations


class SchedulerError(Exception):
    """A request the core cannot serve; `code` is a grpc.StatusCode name."""

    code = "INTERNAL"


class InvalidRequestError(SchedulerError):
    code = "INVALID_ARGUMENT"


class UnknownModelError(SchedulerError):
    code = "NOT_FOUND"


class DuplicateRequestError(SchedulerError):
    """The request id is held for a different model: a client bug, not a retry."""

    code = "ALREADY_EXISTS"


class NoSchedulableInstanceError(SchedulerError):
    """The model is served but no instance can take the request; the message says why."""

    code = "UNAVAILABLE"
