"""``ConfigError``: a bad config value or input file, reported by the CLI as one line, no traceback. Also the
request errors of the HTTP fronts (``ServiceError`` and its kinds, each with its HTTP status): the service and the
OpenAI-compatible endpoint raise them.

Light on purpose (no torch, no Lightning): the data module, the model module and the CLI raise it,
and ``arctic-rl`` prints ``error: <message>`` and exits with status 2 (argparse's code for bad
usage). Anything else that goes wrong keeps its full traceback.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import sys
from collections.abc import Iterator
from typing import Any


class ConfigError(ValueError):
    """A config field or input the user must change; the message names it (``model.sampling.top_p must ...``)."""


def check_positive(**values: int) -> None:
    """Raise naming the first ``model.<name>`` below 1."""
    for name, value in values.items():
        if value < 1:
            raise ConfigError(f"model.{name} must be >= 1, got {value}")


def check_number(key: str, value: Any, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False) -> None:
    """``model.<key>`` must be a finite number within ``[low, high]`` (an ``_open`` end excludes its bound);
    ``None`` for ``low`` / ``high``: unbounded on that side. Raise a ``ConfigError`` naming it otherwise."""
    lo = "(" if low_open else "["
    hi = ")" if high_open else "]"
    wanted = f"{lo}{'-inf' if low is None else low}, {'inf' if high is None else high}{hi}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ConfigError(f"model.{key} must be a finite number in {wanted}, got {value!r}")


class UnwritablePath(ConfigError):
    """A path the run must write to cannot take it (not a directory, read-only, a full disk); the message
    names the path and what to do. An environment fault rather than a bad value, reported the same way."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def os_error_in(exception: BaseException) -> OSError | None:
    """The first ``OSError`` in ``exception``'s chain of causes and contexts (torch.save, for one, reports a
    failed write as ``RuntimeError: ... unexpected pos`` whose context holds the ``ENOSPC``)."""
    seen: BaseException | None = exception
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen


def unwritable(path: object, error: OSError, fix: str) -> UnwritablePath:
    """The one-line error for ``error`` (an ``OSError``) while writing ``path``, with ``fix``."""
    what = "the disk is full" if error.errno in DISK_FULL else (error.strerror or str(error)).lower()
    return UnwritablePath(f"cannot write {path}: {what} ({errno.errorcode.get(error.errno or 0, error.errno)}); {fix}")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "name" or "org/name"


def check_model_path(field: str, value: object) -> None:
    """A string ``value`` must be an existing local path, or shaped like a hub id (``org/name``): a
    path that does not exist fails here, naming the field, not as a hub-id error later. Other values
    (a config dict, None) are not paths and pass."""
    if not isinstance(value, str) or os.path.exists(value):
        return
    if _HUB_ID.fullmatch(value) is None or value.startswith("."):
        raise ConfigError(f"{field}: path {value!r} does not exist (cwd: {os.getcwd()})")


@contextlib.contextmanager
def exit_on_config_error() -> Iterator[None]:
    """Turn a :class:`ConfigError` (also one raised as the cause of another exception, as jsonargparse
    wraps constructor errors) into ``error: <message>`` on stderr and exit status 2."""
    try:
        yield
    except BaseException as e:  # noqa: BLE001  (re-raised unless a ConfigError is in the chain)
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


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
