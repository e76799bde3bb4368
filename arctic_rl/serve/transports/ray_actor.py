"""The Ray transport: ``ServiceActor`` answers wire bytes inside a Ray actor; ``RayTransport`` is its ``Handler``;
``call_actor`` sends one operation to such an actor (the training ranks' actors use it too)."""

from __future__ import annotations

import logging
from typing import Any

from arctic_rl.ray_address import init_address
from arctic_rl.serve import wire
from arctic_rl.serve.errors import JobFailed, ServiceError, ServiceTimeout
from arctic_rl.serve.factory import DEFAULT_FACTORY, build_handler
from arctic_rl.serve.security import DEFAULT_MAX_REQUEST_BYTES
from arctic_rl.serve.transports.serving import Endpoint
from arctic_rl.serve.transport import Message

logger = logging.getLogger(__name__)
_ACTOR_THREADS = 8  # calls enter at once and queue on Endpoint's lock (with deadlines); close() is not stuck behind


class ServiceActor:
    """The handler ``factory(config)`` built inside the actor, answering the same wire bytes HTTP carries
    (so nothing of ours is pickled). A plain class: ``ray.remote(ServiceActor)`` makes the actor."""

    def __init__(self, factory: str, config: dict[str, Any], max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 call_timeout_s: float | None = None):
        self._endpoint = Endpoint(build_handler(factory, config), max_request_bytes=max_request_bytes,
                                  call_timeout_s=call_timeout_s)

    def ready(self) -> bool:
        """True once the handler is built (the constructor returned)."""
        return True

    def call(self, op: str, payload: bytes) -> bytes:
        """The reply's wire bytes; a failure is a reply too, its header's ``error`` naming it."""
        try:
            return self._endpoint.answer(op, payload)
        except Exception as e:  # noqa: BLE001  (every failure is an answer; the actor keeps serving)
            return wire.error_body(op, e)

    def close(self) -> None:
        self._endpoint.handler.close()


def call_actor(actor, op: str, request: Message, timeout_s: float, name: str = "the service actor") -> Message:
    """``op`` run by a ``ServiceActor`` (or an actor with its ``call``), its reply as a ``Message``: the actor's error
    replies come back as the same ``ServiceError`` subclass; the actor's death is ``JobFailed`` (caused by Ray's
    ``RayActorError``), no reply within ``timeout_s`` ``ServiceTimeout``; ``name`` names the actor in them."""
    import ray

    payload = wire.encode(wire.Frame(op, request, timeout_s=timeout_s))
    try:
        reply = ray.get(actor.call.remote(op, payload), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise ServiceTimeout(f"{op!r} got no answer from {name} within {timeout_s:g} s") from e
    except ray.exceptions.RayActorError as e:
        raise JobFailed(f"{name} died during {op!r}: {e}") from e
    except ray.exceptions.RayError as e:
        raise JobFailed(f"{op!r} failed in Ray: {type(e).__name__}: {e}") from e
    return wire.open_reply(reply, op)


class RayTransport:
    """``Handler`` over a ``ServiceActor``: joins the running Ray (or starts one, and shuts down only that).

    Args:
        config: what the handler factory gets, built inside the actor.
        factory: the handler factory's ``"package.module:function"`` path.
        ray_address: passed to ``ray.init`` when Ray is not initialized yet.
        num_cpus, num_gpus: the actor's resources.
        call_timeout_s: how long a call waits unless ``call(timeout_s=...)`` says otherwise.
        startup_timeout_s: how long building the handler may take.

    Errors: the actor's error replies come back as the same ``ServiceError`` subclass; the actor's death
    is ``JobFailed``; no reply in time is ``ServiceTimeout``. ``close()`` closes the handler, kills the actor.
    """

    def __init__(self, config: dict[str, Any], *, factory: str = DEFAULT_FACTORY, ray_address: str | None = None,
                 num_cpus: float = 1, num_gpus: float = 0, call_timeout_s: float = 600.0,
                 startup_timeout_s: float = 300.0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        import ray

        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=init_address(ray_address))
        self._call_timeout_s = call_timeout_s
        self._closed = False
        actor_class = ray.remote(ServiceActor).options(num_cpus=num_cpus, num_gpus=num_gpus,
                                                       max_concurrency=_ACTOR_THREADS)
        self.actor = actor_class.remote(factory, config, max_request_bytes, call_timeout_s)
        try:
            ray.get(self.actor.ready.remote(), timeout=startup_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            self.close()
            raise ServiceTimeout(f"the service actor was not ready after {startup_timeout_s:g} s") from e
        except ray.exceptions.RayError as e:
            self.close()
            raise JobFailed(f"the service actor failed to start: {e}") from e

    def call(self, op: str, request: Message, timeout_s: float | None = None) -> Message:
        """Run ``op`` in the actor and return its reply (see the class for the errors)."""
        if self._closed:
            raise ServiceError("the Ray transport is closed")
        return call_actor(self.actor, op, request, self._call_timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """Close the handler, kill the actor, shut down Ray if this transport started it (idempotent)."""
        import ray

        if self._closed:
            return
        self._closed = True
        try:
            ray.get(self.actor.close.remote(), timeout=self._call_timeout_s)
        except ray.exceptions.RayError as e:  # dead, stuck or failing to close: killed below either way
            logger.warning("the service actor did not close cleanly: %s", e)
        ray.kill(self.actor)
        if self._started_ray:
            ray.shutdown()
