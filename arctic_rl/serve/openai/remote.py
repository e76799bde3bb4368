"""The training loop's side of the OpenAI endpoint: fetch finished sessions from a running server as a ``TrainBatch``."""

from __future__ import annotations

from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.errors import ServiceError


def collect_episodes(server_url: str, auth_token: str | None, session_ids: list[str], rewards: list[float],
                     group: bool = False, timeout_s: float = 60.0) -> TrainBatch:
    """``POST /v1/episodes/collect`` on ``server_url``: the sessions' ``TrainBatch`` (``collect.collect``'s contract);
    the server forgets them. A refusal raises ``ServiceError`` with the server's status and message."""
    import httpx

    from arctic_rl.serve import wire

    headers = {} if auth_token is None else {"Authorization": f"Bearer {auth_token}"}
    reply = httpx.post(f"{server_url.rstrip('/')}/v1/episodes/collect", headers=headers, timeout=timeout_s,
                       json={"session_ids": session_ids, "rewards": rewards, "group": group})
    if reply.status_code != 200:
        error = ServiceError(f"collect: {reply.status_code}: {reply.json()['error']['message']}")
        error.status = reply.status_code
        raise error
    return TrainBatch.from_message(wire.decode(reply.content).message)
