"""Errors users can act on, and the one place they become gRPC status codes."""

from __future__ import annotations

import sys

import grpc


class ServiceError(Exception):
    """Base of errors carrying their gRPC status code."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequestError(ServiceError, ValueError):
    """The request itself is wrong (bad field, undecodable input)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(ServiceError, LookupError):
    """A named thing (model, request id) does not exist here."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(ServiceError):
    """A request id is already in use."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhaustedError(ServiceError):
    """The request can never fit this server's KV cache or limits."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceededError(ServiceError):
    """The call's gRPC deadline passed, or will pass before its work can start: the work was not done."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnavailableError(ServiceError):
    """A peer service (encoder, Redis) failed or timed out; retrying may work."""

    code = grpc.StatusCode.UNAVAILABLE


class UnauthenticatedError(ServiceError):
    """An internal call (Encode) without the deployment's internal token (``shared.internal_auth``)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(ServiceError):
    """An authenticated call asks for something its caller did not reserve (a forged KV target)."""

    code = grpc.StatusCode.PERMISSION_DENIED


# Exit status of a service whose port cannot be bound (EADDRINUSE's errno on Linux):
# encdec.launcher picks other free ports and starts it again.
BIND_ERROR_EXIT = 98


class BindError(RuntimeError):
    """A gRPC server cannot listen on its address (port taken, or the host is not local)."""


class ServicesError(RuntimeError):
    """``encdec.launcher`` could not start a service: its port is taken, it exited, or it never became healthy."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """Maps an exception to ``(status code, message)``.

    ``ServiceError`` subclasses carry their own code; other ``ValueError``s
    (validation in dataclasses, audio decoding) are INVALID_ARGUMENT; anything
    else is INTERNAL (an ``IndexError`` inside a model is a bug, not NOT_FOUND).
    """
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    # Looked up, not imported: a redis error exists only once redis-py is loaded, and the
    # GPU check machine (scripts/gpu_check.sh) imports this module without redis-py installed.
    redis_errors = sys.modules.get("redis.exceptions")
    if redis_errors is not None and isinstance(exc, (redis_errors.ConnectionError, redis_errors.TimeoutError)):
        return grpc.StatusCode.UNAVAILABLE, f"request-state store unavailable: {exc}"
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
