"""``arctic-rl serve``: the HTTP service in its own process (uvicorn), until SIGTERM or SIGINT closes it.

    python -m arctic_rl.serve.server --config job.yaml --port 0 --ready-file /tmp/ready.json

Prints ``arctic-rl serve: listening on http://HOST:PORT`` once it accepts connections (and writes
``{"url", "pid", "protocol"}`` to ``--ready-file``). ``start_server_process`` launches it from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from arctic_rl.errors import ConfigError
from arctic_rl.serve.errors import ServiceError
from arctic_rl.serve.factory import DEFAULT_FACTORY, load_factory
from arctic_rl.serve.transports.process import ServerProcess, start_server_process  # noqa: F401  (launched from here before)
from arctic_rl.serve.security import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_REQUEST_MB, check_bind

READY_LINE = "arctic-rl serve: listening on {url}"
TINKER_KEY_PREFIXES = ("tml-", "eyJ")  # the API keys the tinker SDK sends (an opaque key, or a JWT); it refuses others


class StartRefused(ValueError):
    """The server will not start as asked (an open host without a token, a bad config or ``--set``)."""


class _Stopped(Exception):
    """SIGTERM or SIGINT arrived: stop serving, close the handler."""


def serve(handler_factory: str | Callable[[dict[str, Any]], Any], config: dict[str, Any] | None = None, *,
          host: str = "127.0.0.1", port: int = 0, auth_token: str | None = None,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, call_timeout_s: float | None = None,
          ready_file: str | os.PathLike | None = None, shutdown_grace_s: float = 5.0,
          log_level: str = "warning", api: str = "arctic") -> None:
    """Serve ``handler_factory(config)`` over HTTP until SIGTERM/SIGINT, then close the handler.

    Args:
        handler_factory: a function of the config dict, or its ``"package.module:function"`` path.
        config: what the factory gets (``{}`` when None).
        host, port: where to listen; port 0 picks a free port (the printed line names it).
        auth_token: the bearer token every route but health requires. Refused as None on a non-loopback host.
        max_request_bytes: bodies over this are answered 413 before they are read.
        call_timeout_s: the longest one operation may take (a request may ask for less).
        ready_file: written (JSON: url, pid, protocol) once connections are accepted.
        shutdown_grace_s: how long in-flight requests may finish after a signal before they are cancelled.
        api: ``arctic`` (the wire format of docs/backend.md), ``tinker`` (the Tinker SDK's routes, docs/tinker.md;
            the default handler factory only) or ``openai`` (the arctic routes and OpenAI's chat and text completions
            with their tokens recorded as episodes, docs/agents.md; the default handler factory only).
    """
    check_bind(host, auth_token)  # a ConfigError: anyone who can reach the port could drive the job
    if api == "tinker" and auth_token is not None and not auth_token.startswith(TINKER_KEY_PREFIXES):
        raise StartRefused("--api tinker: the auth token must start with 'tml-', since the tinker SDK refuses any other "
                           "API key and no client could connect; e.g. --auth-token tml-$(openssl rand -hex 16)")
    previous = _catch_stop_signals()
    handler = sock = None
    try:
        sock = _listening_socket(host, port)
        url = f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}"
        factory = load_factory(handler_factory) if isinstance(handler_factory, str) else handler_factory
        handler = factory({} if config is None else config)
        app = _create_app(api, handler, auth_token, max_request_bytes, call_timeout_s)
        asyncio.run(_run_until_stopped(app, sock, url, ready_file, shutdown_grace_s, log_level))
    except _Stopped:
        pass
    finally:
        for sig, action in previous.items():
            signal.signal(sig, action)
        if sock is not None:
            sock.close()
        if handler is not None:
            _close_handler(handler)


def _create_app(api: str, handler: Any, auth_token: str | None, max_request_bytes: int, call_timeout_s: float | None):
    """The FastAPI app of ``api`` over ``handler`` (heavy imports here, so --help stays fast)."""
    if api == "tinker":
        from arctic_rl.serve.ops import CoreHandler

        if not isinstance(handler, CoreHandler):
            raise StartRefused(f"--api tinker serves the training core of the default handler ({DEFAULT_FACTORY}), "
                               f"not a {type(handler).__name__}")
        try:
            import tinker.proto.tinker_public_pb2  # noqa: F401  (the SDK's messages, which the routes read and write)
        except ImportError as e:
            raise StartRefused(f"--api tinker needs the tinker package (pip install 'arctic-rl[tinker]'): {e}") from None
        import arctic_rl.serve.tinker.losses  # noqa: F401  (registers the tinker.* losses in this process)
        from arctic_rl.serve.tinker.app import create_tinker_app
        from arctic_rl.serve.tinker.service import TinkerService

        return create_tinker_app(TinkerService(handler.core), auth_token=auth_token, max_request_bytes=max_request_bytes)
    from arctic_rl.serve.transports.http_app import create_app

    app = create_app(handler, auth_token=auth_token, max_request_bytes=max_request_bytes, call_timeout_s=call_timeout_s)
    if api == "openai":
        from arctic_rl.serve.ops import CoreHandler

        if not isinstance(handler, CoreHandler):
            raise StartRefused(f"--api openai serves the training core of the default handler ({DEFAULT_FACTORY}), "
                               f"not a {type(handler).__name__}")
        from arctic_rl.serve.openai.app import add_openai_routes
        from arctic_rl.serve.openai.service import openai_service

        add_openai_routes(app, openai_service(handler.core), auth_token=auth_token, max_request_bytes=max_request_bytes)
    return app


def _close_handler(handler: Any) -> None:
    """Close the handler; a job that stopped waiting for an operation says so in one line (the process then
    exits without it)."""
    try:
        handler.close()
    except ServiceError as e:
        print(f"arctic-rl serve: {e}", file=sys.stderr, flush=True)


async def _run_until_stopped(app, sock: socket.socket, url: str, ready_file, shutdown_grace_s: float,
                             log_level: str) -> None:
    """uvicorn on ``sock``; the ready line (and file) once it accepts connections."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=shutdown_grace_s))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        print(READY_LINE.format(url=url), flush=True)
        if ready_file is not None:
            _write_ready_file(Path(ready_file), url)
    await serving


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port``. Made with proto IPPROTO_TCP, not 0 (``socket.create_server``):
    asyncio turns on TCP_NODELAY only for such sockets, and without it each reply's body waits for the
    client's delayed ACK of its headers (about 40 ms per call)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except BaseException as e:
        sock.close()
        if isinstance(e, OSError) and (refusal := _bind_refusal(e, host, port)) is not None:
            raise StartRefused(refusal) from None
        raise
    return sock


def _bind_refusal(error: OSError, host: str, port: int) -> str | None:
    """The one line that says why ``host:port`` cannot be listened on, and what to do (None: not a user mistake)."""
    if error.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is already in use: stop what listens there, or pick another --port (0: a free port)"
    if error.errno == errno.EACCES:
        return f"port {port} on {host}: permission denied (ports below 1024 need root): pick another --port"
    if error.errno == errno.EADDRNOTAVAIL or isinstance(error, socket.gaierror):
        return f"cannot listen on {host}: not an address of this machine ({error.strerror}): fix --host"
    return None


def _catch_stop_signals() -> dict[int, Any]:
    """Make SIGTERM/SIGINT raise ``_Stopped`` (uvicorn re-raises them after its graceful shutdown)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum: int, frame: Any) -> None:
        raise _Stopped(signal.Signals(signum).name)

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}


def _write_ready_file(path: Path, url: str) -> None:
    from arctic_rl.serve.wire import PROTOCOL_VERSION

    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"url": url, "pid": os.getpid(), "protocol": PROTOCOL_VERSION}))
    os.replace(partial, path)  # readers never see half a file


def load_config(path: str | None, overrides: list[str]) -> dict[str, Any]:
    """The ``--config`` YAML as a dict (``{}`` without one), its relative paths resolved against the file's
    directory (``config_paths.py``: ``tokenizer``, ``root_dir``, values starting with ``./`` or ``../``), with
    ``--set dotted.key=value`` applied (values parsed as YAML, paths left relative to the working directory)."""
    import yaml

    config = {} if path is None else yaml.safe_load(Path(path).read_text())
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise StartRefused(f"--config {path}: expected a mapping at the top, got {type(config).__name__}")
    if path is not None:  # relative paths in the file are relative to the file, as for fit (config_paths.py)
        from arctic_rl.config_paths import resolve_paths

        config = resolve_paths(config, Path(path).resolve().parent)
    for item in overrides:
        dotted, sep, value = item.partition("=")
        if not sep or not dotted:
            raise StartRefused(f"--set expects dotted.key=value, got {item!r}")
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise StartRefused(f"--set {item!r}: {key!r} is not a mapping in the config")
        node[leaf] = yaml.safe_load(value)
    return config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arctic-rl serve", description=__doc__.split("\n")[0])
    p.add_argument("--api", choices=("arctic", "tinker", "openai"), default="arctic",
                   help="the routes: arctic-rl's wire format (docs/backend.md), the Tinker SDK's (docs/tinker.md), or "
                        "arctic-rl's and OpenAI's chat/completions recorded as episodes (docs/agents.md)")
    p.add_argument("--handler", default=DEFAULT_FACTORY, help="package.module:function called with the config dict")
    p.add_argument("--config", help="a YAML file; its mapping is what the handler factory gets")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a (dotted) config key")
    p.add_argument("--host", help="interface to listen on (default: the config's server.host, else 127.0.0.1)")
    p.add_argument("--port", type=int, help="0 picks a free port (default: the config's server.port, else 0)")
    p.add_argument("--auth-token", help="bearer token (default: the config's auth_token, else $ARCTIC_RL_TOKEN); required off loopback")
    p.add_argument("--ready-file", help="written as JSON {url, pid, protocol} once connections are accepted")
    p.add_argument("--max-request-bytes", type=int, help=f"default: the config's server.max_request_mb, else {DEFAULT_MAX_REQUEST_MB:g} MiB")
    p.add_argument("--call-timeout-s", type=float, help="the longest one operation may run (default: no limit)")
    p.add_argument("--log-level", default="warning")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the server; returns the exit status (2 when refused to start)."""
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        section = config.get("server") if isinstance(config.get("server"), dict) else {}  # ArcticRLClientConfig's
        limit = args.max_request_bytes or int(section.get("max_request_mb", DEFAULT_MAX_REQUEST_BYTES / 2**20) * 2**20)
        serve(args.handler, config, host=args.host or section.get("host", "127.0.0.1"),
              port=args.port if args.port is not None else section.get("port", 0),
              auth_token=args.auth_token or config.get("auth_token") or os.environ.get("ARCTIC_RL_TOKEN") or None,
              max_request_bytes=limit, call_timeout_s=args.call_timeout_s,
              ready_file=args.ready_file, log_level=args.log_level, api=args.api)
    except (StartRefused, ConfigError) as e:
        print(f"arctic-rl serve: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # do not wait for a handler call still running in a worker thread
