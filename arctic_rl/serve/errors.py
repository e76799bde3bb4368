"""Errors of the service, each with the HTTP status a transport answers it with.

Light on purpose (no torch): transports, the client and the core all raise and map them. A
``RequestError`` means the request was refused *before* the job's state changed."""

from __future__ import annotations


class ServiceError(RuntimeError):
    """Base class; ``status`` is the HTTP status code a transport answers with."""

    status = 500


class RequestError(ServiceError, ValueError):
    """A malformed or inconsistent request (wrong shapes, unknown loss or processor, non-finite
    inputs, NaN loss). The message names the field; the job's state is untouched."""

    status = 400


class AuthError(ServiceError):
    """Missing or wrong bearer token."""

    status = 401


class PathRefused(RequestError):
    """A ``save_state``/``load_state``/``export`` path outside the server's root."""

    status = 403


class UnknownOperation(RequestError):
    """An operation name the service does not have."""

    status = 404


class PayloadTooLarge(RequestError):
    """A request over the server's size limit."""

    status = 413


class JobFailed(ServiceError):
    """The training job died (an engine, a worker or the core thread); the message names it. Every
    later call fails with this too, until the client is closed."""

    status = 503


class ServiceTimeout(ServiceError):
    """A call did not finish within its timeout (the server or an engine is not answering)."""

    status = 504


ERRORS_BY_NAME = {cls.__name__: cls for cls in (ServiceError, RequestError, AuthError, PathRefused, UnknownOperation,
                                                PayloadTooLarge, JobFailed, ServiceTimeout)}
