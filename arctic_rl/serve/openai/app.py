"""The OpenAI transport (``arctic-rl serve --api openai``): the endpoint's completion routes
(``arctic_rl.rollout.openai.routes``), the recorded episodes (``/v1/episodes/...``), beside the service's own routes
(``/v1/ops/{op}``) on one app with one token. It only translates; ``OpenAIService`` decides."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from arctic_rl.errors import ServiceError
from arctic_rl.rollout.openai.routes import add_completion_routes, openai_error
from arctic_rl.rollout.openai.service import OpenAIService
from arctic_rl.serve import wire
from arctic_rl.serve.openai.collect import collect
from arctic_rl.serve.security import check_bearer
from arctic_rl.serve.transports.http_app import read_limited


def add_openai_routes(app: FastAPI, service: OpenAIService, *, auth_token: str | None, max_request_bytes: int) -> FastAPI:
    """Add the OpenAI routes to ``app`` (the service's app); each needs ``Authorization: Bearer <token>``."""

    def require_token(request: Request) -> None:
        check_bearer(request.headers.get("authorization"), auth_token)

    async def read(request: Request) -> bytes:
        return await read_limited(request, max_request_bytes)

    auth = [Depends(require_token)]
    body = add_completion_routes(app, service, dependencies=auth, read=read)

    @app.get("/v1/episodes/{session_id}", dependencies=auth)
    async def episode(session_id: str) -> Response:
        try:
            recorded = service.store.get(session_id)
        except ServiceError as e:
            return openai_error(e)
        return JSONResponse({"session_id": session_id, "divergences": recorded.divergences,
                             "segments": [s.as_json() for s in recorded.segments]})

    @app.delete("/v1/episodes/{session_id}", dependencies=auth)
    async def drop_episode(session_id: str) -> Response:
        try:
            service.store.drop(session_id)
        except ServiceError as e:
            return openai_error(e)
        return JSONResponse({"session_id": session_id, "dropped": True})

    @app.post("/v1/episodes/collect", dependencies=auth)
    async def collect_episodes(request: Request) -> Response:
        """``{"session_ids", "rewards", "group"}`` -> the ``TrainBatch`` in the service's wire format (op ``collect``)."""
        try:
            req = await body(request)
            batch = collect(service.store, req.get("session_ids"), req.get("rewards"), bool(req.get("group", False)))
        except Exception as e:  # noqa: BLE001
            return openai_error(e)
        return Response(wire.encode(wire.Frame("collect", batch.to_message())), media_type=wire.CONTENT_TYPE)

    return app
