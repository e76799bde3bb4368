"""The service's guards: who may listen where (``check_bind``), who may call (``check_bearer``; the Tinker API's
``check_api_key``), which paths a request may name (``confine_path``) and how large a request may be
(``DEFAULT_MAX_REQUEST_MB``).

Light on purpose (no torch): the config, the server and the core all use it."""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path

from arctic_rl.errors import ConfigError
from arctic_rl.serve.errors import AuthError, PathRefused

LOOPBACK_NAMES = ("localhost",)  # host names taken as loopback without asking DNS
DEFAULT_MAX_REQUEST_MB = 512.0  # the largest request body by default: server.max_request_mb, arctic-rl serve, Ray
DEFAULT_MAX_REQUEST_BYTES = int(DEFAULT_MAX_REQUEST_MB * 2**20)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only: ``localhost``, ``127.0.0.0/8``, ``::1`` (also ``[::1]``
    and ``::ffff:127.0.0.1``). Anything else, ``""`` and ``0.0.0.0`` included, is not: other names are
    not resolved, so a name that happens to resolve to loopback still counts as remote (the safe side)."""
    name = host.strip().lower().rstrip(".")
    if name in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_bind(host: str, token: str | None) -> None:
    """Refuse to listen on a non-loopback ``host`` without an auth token (anyone who can reach the port
    could otherwise drive training and read or write files under the server's root).

    Raises:
        ConfigError: ``host`` is not loopback and ``token`` is None or empty.
    """
    if not token and not is_loopback(host):
        raise ConfigError(f"refusing to listen on {host or '<all interfaces>'} without an auth token: "
                          "set auth_token or ARCTIC_RL_TOKEN")


def check_bearer(header_value: str | None, expected: str | None) -> None:
    """Check an ``Authorization`` header against the server's token, in constant time.

    Args:
        header_value: the header as received (``"Bearer <token>"``; the scheme is case-insensitive), or
            None when absent.
        expected: the server's token; None means the server has no token and every caller is allowed.

    Raises:
        AuthError: the header is missing, not ``Bearer <token>``, or names another token. The message
            never contains the token, given or expected.
    """
    if expected is None:
        return
    if header_value is None:
        raise AuthError("missing Authorization header; send 'Authorization: Bearer <token>'")
    scheme, _, given = header_value.strip().partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        raise AuthError("malformed Authorization header; expected 'Bearer <token>'")
    if not hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8")):
        raise AuthError("wrong bearer token")


def check_api_key(x_api_key: str | None, authorization: str | None, expected: str | None) -> None:
    """The Tinker SDK's credential (``X-API-Key: <token>``) against the server's token, in constant time; a
    ``Authorization: Bearer <token>`` header is checked by ``check_bearer`` instead. The SDK only sends keys that
    start with ``tml-``, so a server for it takes a token of that form.

    Raises:
        AuthError: no credential, or another token (the message never contains either).
    """
    if expected is None:
        return
    if x_api_key is None:
        return check_bearer(authorization, expected)
    if not hmac.compare_digest(x_api_key.strip().encode("utf-8"), expected.encode("utf-8")):
        raise AuthError("wrong API key")


def confine_path(root: str | Path, requested: str) -> Path:
    """The resolved path ``requested`` names under ``root``, refusing any way out of ``root``.

    ``requested`` is relative to ``root`` (an absolute path is allowed only when it lies inside
    ``root``). Symlinks are followed before the check, so a link pointing out of ``root`` is refused.
    ``root`` is created when missing. What the check cannot see: a symlink swapped in *after* it
    returns; keep ``root`` writable by the server only.

    Raises:
        PathRefused: ``requested`` is empty, not a string, contains a NUL byte, or resolves outside
            ``root`` (``..`` escapes, absolute paths elsewhere, symlinks out, symlink loops).
    """
    if not isinstance(requested, str):
        raise PathRefused(f"path must be a string, got {type(requested).__name__}")
    if not requested.strip():
        raise PathRefused(f"path {requested!r} is empty; give a path relative to the server's root_dir")
    if "\x00" in requested:
        raise PathRefused(f"path {requested!r} contains a NUL byte")
    base = Path(root).expanduser()
    base.mkdir(parents=True, exist_ok=True)
    base = base.resolve(strict=True)
    try:
        resolved = (base / requested).resolve()  # an absolute ``requested`` replaces ``base``
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise PathRefused(f"path {requested!r} cannot be resolved: {e}") from None
    if resolved != base and not resolved.is_relative_to(base):
        raise PathRefused(f"path {requested!r} is outside the server's root_dir; give a path relative to it")
    return resolved
