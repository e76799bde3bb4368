"""Errors of the service, each with the HTTP status a transport answers it with (defined in ``arctic_rl.errors``,
beside ``ConfigError``, so that the rollout's OpenAI-compatible endpoint raises the same ones).

Light on purpose (no torch): transports, the client and the core all raise and map them. A
``RequestError`` means the request was refused *before* the job's state changed."""

from __future__ import annotations

from arctic_rl.errors import (AuthError, JobFailed, PathRefused, PayloadTooLarge, RequestError, ServiceError, ServiceTimeout,
                              UnknownOperation)

__all__ = ["ServiceError", "RequestError", "AuthError", "PathRefused", "UnknownOperation", "PayloadTooLarge", "JobFailed",
           "ServiceTimeout", "ERRORS_BY_NAME"]

ERRORS_BY_NAME = {cls.__name__: cls for cls in (ServiceError, RequestError, AuthError, PathRefused, UnknownOperation,
                                                PayloadTooLarge, JobFailed, ServiceTimeout)}
