"""Episodes of an OpenAI-compatible endpoint: per session, the exact token sequences the server built and sampled,
grown turn by turn when a new request's prompt extends a recorded sequence token for token, split (and counted)
when it does not; ``collect`` turns finished sessions into a ``TrainBatch``.

Pure bookkeeping over token ids (no tokenizer, no engine): the caller hands it the prompt ids it rendered and the
completions the engine sampled."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from arctic_rl.rollout.engines.base import Completion
from arctic_rl.errors import RequestError, UnknownOperation

logger = logging.getLogger(__name__)
MAX_SESSION_ID_CHARS = 128
MAX_OPEN_SESSIONS = 65536  # episodes held in memory until collected or dropped; a new session past this is refused


@dataclass
class Segment:
    """One token sequence of an episode: the first prompt, then every later token, generated (mask 1) or the
    environment's (mask 0: tool results, the user's next message, the chat template's framing between turns)."""

    prompt_ids: list[int]  # the first turn's prompt, as the server rendered it
    response_ids: list[int] = field(default_factory=list)  # every token after the prompt
    loss_mask: list[int] = field(default_factory=list)  # per response token: 1 sampled, 0 environment
    logprobs: list[float] = field(default_factory=list)  # per response token: the sampler's (0.0 on environment tokens)
    versions: list[int] = field(default_factory=list)  # per response token: the weights that sampled it (-1: environment)
    turns: int = 0  # completions in this sequence
    finish_reason: str = ""  # of the last completion
    client_disconnected: bool = False  # the client left while its last completion was streamed

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append(self, completion: Completion, environment: list[int]) -> None:
        """Grow by ``environment`` tokens (mask 0), then the completion's sampled tokens (mask 1)."""
        version = -1 if completion.weight_version is None else completion.weight_version
        versions = completion.token_versions or [version] * len(completion.token_ids)
        self.response_ids += environment + list(completion.token_ids)
        self.loss_mask += [0] * len(environment) + [1] * len(completion.token_ids)
        self.logprobs += [0.0] * len(environment) + list(completion.logprobs)
        self.versions += [-1] * len(environment) + list(versions)
        self.turns += 1
        self.finish_reason = completion.finish_reason

    def as_json(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids, "loss_mask": self.loss_mask,
                "logprobs": self.logprobs, "versions": self.versions, "turns": self.turns,
                "finish_reason": self.finish_reason, "client_disconnected": self.client_disconnected}


@dataclass
class Episode:
    """A session's segments and how often a turn did not extend any of them (``divergences``)."""

    segments: list[Segment] = field(default_factory=list)
    divergences: int = 0


def check_session_id(session_id: object, where: str) -> str:
    """``session_id`` as a non-empty string of at most ``MAX_SESSION_ID_CHARS`` characters, else ``RequestError``."""
    if not isinstance(session_id, str) or not session_id.strip() or len(session_id) > MAX_SESSION_ID_CHARS:
        raise RequestError(f"{where} must be a non-empty string of at most {MAX_SESSION_ID_CHARS} characters, got {session_id!r}")
    return session_id


class EpisodeStore:
    """The server's episodes by session id; thread-safe (requests are answered in worker threads)."""

    def __init__(self, warn_each: bool = True) -> None:
        self.warn_each = warn_each  # a warning per divergence (else the caller reports them, as fit's agent rollouts do per batch)
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self.divergences = 0  # over all sessions since start

    def record(self, session_id: str, prompt_ids: list[int], completions: list[Completion],
               client_disconnected: bool = False) -> list[int]:
        """Record one request's ``completions`` of ``prompt_ids`` (``n`` of them); returns each one's segment index.
        ``client_disconnected``: the client left while they were streamed (their segments flagged, as
        :meth:`mark_disconnected` flags them).

        The first completion extends the longest segment whose tokens are a prefix of ``prompt_ids`` (the tokens
        between are the environment's); the others (``n > 1``) branch from that segment as new ones. A prompt that
        extends no segment of a session that has some starts new segments, and counts as a divergence."""
        with self._lock:
            self._check_room(session_id)
            episode = self._episodes.setdefault(session_id, Episode())
            base = _longest_prefix(episode.segments, prompt_ids)
            if base is None and episode.segments:
                episode.divergences += 1
                self.divergences += 1
                (logger.warning if self.warn_each else logger.debug)("session %r: the prompt (%d tokens) does not extend any of its %d recorded sequences token "
                               "for token; recorded as a new segment (divergences: %d)", session_id, len(prompt_ids),
                               len(episode.segments), episode.divergences)
            origin = None if base is None else _branch(episode.segments[base])  # before the first completion grows it
            indices = []
            for i, completion in enumerate(completions):
                if base is not None and i == 0:
                    index = base
                else:
                    episode.segments.append(Segment(list(prompt_ids)) if origin is None else _branch(origin))
                    index = len(episode.segments) - 1
                segment = episode.segments[index]
                segment.append(completion, list(prompt_ids[len(segment.token_ids):]))
                segment.client_disconnected |= client_disconnected
                indices.append(index)
        if client_disconnected:
            self._warn_disconnected(session_id, indices)
        return indices

    def check_room(self, session_id: str) -> None:
        """Refuse (``RequestError``) a new session while ``MAX_OPEN_SESSIONS`` are open, before anything is sampled for
        it (``record`` checks again)."""
        with self._lock:
            self._check_room(session_id)

    def _check_room(self, session_id: str) -> None:
        if session_id not in self._episodes and len(self._episodes) >= MAX_OPEN_SESSIONS:
            raise RequestError(f"user / X-Session-Id {session_id!r}: {MAX_OPEN_SESSIONS} sessions are open; collect or "
                               "drop finished ones (POST /v1/episodes/collect, DELETE /v1/episodes/{id}) first")

    def mark_disconnected(self, session_id: str, segments: list[int]) -> None:
        """The client left while these segments' last completions were streamed to it (a session collected or dropped
        meanwhile is gone: nothing to flag)."""
        with self._lock:
            episode = self._episodes.get(session_id)
            if episode is None:
                return
            for index in segments:
                episode.segments[index].client_disconnected = True
        self._warn_disconnected(session_id, segments)

    @staticmethod
    def _warn_disconnected(session_id: str, segments: list[int]) -> None:
        logger.warning("session %r: the client disconnected mid-stream; segments %s are recorded as sampled, flagged "
                       "client_disconnected", session_id, segments)

    def get(self, session_id: str) -> Episode:
        with self._lock:
            if session_id not in self._episodes:
                raise UnknownOperation(f"session {session_id!r} has no recorded episode")
            return self._episodes[session_id]

    def drop(self, session_id: str) -> None:
        """Forget a session's episode (an abandoned one), unknown ids refused."""
        self.pop([session_id])

    def pop(self, session_ids: list[str]) -> list[Episode]:
        """Remove and return these sessions' episodes; an unknown id refuses them all (nothing removed)."""
        with self._lock:
            unknown = [s for s in session_ids if s not in self._episodes]
            if unknown:
                raise UnknownOperation(f"session_ids: {unknown} have no recorded episode")
            return [self._episodes.pop(s) for s in session_ids]


def _longest_prefix(segments: list[Segment], prompt_ids: list[int]) -> int | None:
    best, best_length = None, -1
    for index, segment in enumerate(segments):
        tokens = segment.token_ids
        if best_length < len(tokens) <= len(prompt_ids) and prompt_ids[: len(tokens)] == tokens:
            best, best_length = index, len(tokens)
    return best


def _branch(segment: Segment) -> Segment:
    """A copy of ``segment`` that a sibling completion (``n > 1``) grows instead."""
    return Segment(list(segment.prompt_ids), list(segment.response_ids), list(segment.loss_mask), list(segment.logprobs),
                   list(segment.versions), segment.turns)
