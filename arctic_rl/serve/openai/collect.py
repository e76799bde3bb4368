"""``collect``: finished sessions of the OpenAI-compatible endpoint as one ``TrainBatch``, one reward per session."""

from __future__ import annotations

import math

import torch

from arctic_rl.serve.batch import TrainBatch
from arctic_rl.errors import RequestError
from arctic_rl.rollout.openai.episodes import EpisodeStore, check_session_id


def collect(store: EpisodeStore, session_ids: list[str], rewards: list[float], group: bool = False) -> TrainBatch:
    """Remove the sessions' episodes from ``store`` and return them as a batch, every segment of a session a row.

    Args:
        session_ids: the finished sessions, each once.
        rewards: one per session. Each row's ``advantages`` is its session's reward, or with ``group`` the GRPO
            advantage over the sessions as one group (``(r - mean) / (std + 1e-4)``, ``group_advantages``).
        group: the sessions are one GRPO group (at least two).

    Returns:
        A ``TrainBatch``: ``response_mask`` 1 on sampled tokens, 0 on the environment's; ``sampler_logprobs`` the
        engine's (0 on environment tokens). Raises ``RequestError`` naming the field (nothing removed then), or
        ``UnknownOperation`` (404) for a session with no episode.
    """
    if not isinstance(session_ids, list) or not session_ids:
        raise RequestError("session_ids must be a non-empty list of session ids")
    for i, sid in enumerate(session_ids):
        check_session_id(sid, f"session_ids[{i}]")
    if len(set(session_ids)) != len(session_ids):
        raise RequestError("session_ids: each session may be collected once")
    if not isinstance(rewards, list) or len(rewards) != len(session_ids):
        raise RequestError(f"rewards must be a list of {len(session_ids)} numbers, one per session")
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) for r in rewards):
        raise RequestError(f"rewards must be finite numbers, got {rewards}")
    if group and len(session_ids) < 2:
        raise RequestError("group: a GRPO group needs at least two sessions")
    advantages = torch.tensor(rewards, dtype=torch.float32)
    if group:
        from arctic_rl.modules.advantages import group_advantages

        advantages = group_advantages(advantages, len(rewards), "grpo", "group")
    episodes = store.pop(session_ids)
    segments = [(seg, float(adv)) for episode, adv in zip(episodes, advantages) for seg in episode.segments]
    return TrainBatch.build([s.prompt_ids for s, _ in segments], [s.response_ids for s, _ in segments],
                            [a for _, a in segments], loss_masks=[s.loss_mask for s, _ in segments],
                            sampler_logprobs=[s.logprobs for s, _ in segments])
