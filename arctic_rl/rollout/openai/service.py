"""``OpenAIService``: a chat or text completion request checked and rendered (``prepare``), sampled through a
``Sampler`` (the service's core, or ``fit``'s engine in agent rollouts) and recorded token for token in the
``EpisodeStore`` (``run``); its answers are OpenAI's response objects (plain dicts)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from arctic_rl.errors import RequestError
from arctic_rl.rollout.engines.base import Completion, DecodeListener
from arctic_rl.rollout.openai.episodes import EpisodeStore
from arctic_rl.rollout.openai.fields import (Sampling, chat_prompt, parse_tool_calls, sampling_of, session_of,
                                              text_prompt)


class SampleOutput(Protocol):  # what ``Sampler.sample`` returns: per prompt, its completions
    completions: list[list[Completion]]


class Sampler(Protocol):
    """What the endpoint samples through: the service's core (``Operations.sample``) or ``fit``'s engine. ``listener``
    is passed only for a streamed request; a sampler that cannot stream never calls it."""

    def sample(self, prompts: list[list[int]], n: int = 1, max_tokens: int | None = None, temperature: float = 1.0,
               top_p: float = 1.0, seed: int | None = None, stop_token_ids: list[int] = (),
               listener: DecodeListener | None = None) -> SampleOutput: ...


@dataclass(frozen=True)
class CompletionRequest:
    """One request, checked and rendered: what the engine samples, and the answer's identity."""

    session_id: str
    prompt_ids: list[int]
    sampling: Sampling
    chat: bool
    model: str
    created: int
    id: str


@dataclass
class Sampled:
    """One request's completions as sampled and recorded, ready to be answered whole or streamed."""

    session_id: str
    prompt_ids: list[int]
    completions: list[Completion]
    segments: list[int]  # each completion's segment in the session's episode
    sampling: Sampling
    chat: bool
    model: str
    created: int
    id: str

    @property
    def request(self) -> CompletionRequest:
        return CompletionRequest(self.session_id, self.prompt_ids, self.sampling, self.chat, self.model, self.created, self.id)


class OpenAIService:
    """The endpoint's logic over a sampler (``ServiceCore``, ``RankedCore`` or ``fit``'s engine) and the model's
    tokenizer. ``admit(session_id, prompt_ids, sampling, body) -> sampling``, when given, replaces the length checks:
    it refuses a request (``RequestError``) or says how to sample it (``fit``'s agent rollouts: the run's temperature,
    a token budget per episode, each turn of each episode from its own seed)."""

    def __init__(self, core: Sampler, tokenizer, model_name: str, max_prompt_length: int, max_response_length: int,
                 admit: Callable[[str, list[int], Sampling, dict], Sampling] | None = None):
        self.core, self.tokenizer, self.model_name = core, tokenizer, model_name
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.admit = admit
        self.store = EpisodeStore()

    def sample(self, body: dict[str, Any], session_header: str | None, chat: bool,
               listener: DecodeListener | None = None) -> Sampled:
        """Check the request, render its prompt, sample ``n`` completions through the core, record them
        (:meth:`prepare`, then :meth:`run`)."""
        return self.run(self.prepare(body, session_header, chat), listener)

    def prepare(self, body: dict[str, Any], session_header: str | None, chat: bool) -> CompletionRequest:
        """Check the request and render its prompt (a ``RequestError`` naming the field; nothing sampled or recorded)."""
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        session_id = session_of(body, session_header)
        self.store.check_room(session_id)
        sampling = sampling_of(body, self.tokenizer, chat)
        prompt_ids = chat_prompt(body, self.tokenizer) if chat else text_prompt(body, self.tokenizer)
        if self.admit is not None:
            sampling = self.admit(session_id, prompt_ids, sampling, body)
        else:
            self.check_lengths(prompt_ids, sampling, chat)
        return CompletionRequest(session_id, prompt_ids, sampling, chat, self.model_name, int(time.time()),
                                 f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}")

    def check_lengths(self, prompt_ids: list[int], sampling: Sampling, chat: bool) -> None:
        if len(prompt_ids) > self.max_prompt_length:
            raise RequestError(f"{'messages' if chat else 'prompt'}: the prompt is {len(prompt_ids)} tokens, over the "
                               f"server's sampling.max_prompt_length={self.max_prompt_length}")
        if sampling.max_tokens is not None and sampling.max_tokens > self.max_response_length:
            raise RequestError(f"max_tokens={sampling.max_tokens} is over the server's sampling.max_response_length="
                               f"{self.max_response_length}")

    def run(self, request: CompletionRequest, listener: DecodeListener | None = None) -> Sampled:
        """:meth:`complete`, then :meth:`record`."""
        return self.record(request, self.complete(request, listener))

    def complete(self, request: CompletionRequest, listener: DecodeListener | None = None) -> list[Completion]:
        """The request's ``n`` completions, sampled through the core. ``listener``: told each decode step's tokens
        where the core's engine streams, and asked whether to stop early (``Operations.sample``; passed only when
        given, so a non-streamed request calls the core as it always did)."""
        sampling = request.sampling
        streamed = {} if listener is None else {"listener": listener}
        out = self.core.sample([request.prompt_ids], n=sampling.n, max_tokens=sampling.max_tokens,
                               temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                               stop_token_ids=list(sampling.stop_token_ids), **streamed)
        return out.completions[0]

    def record(self, request: CompletionRequest, completions: list[Completion], client_disconnected: bool = False) -> Sampled:
        """Record ``completions`` in the request's session exactly as the engine returned them (``EpisodeStore.record``;
        ``client_disconnected``: flag their segments, in the same step)."""
        segments = self.store.record(request.session_id, request.prompt_ids, completions, client_disconnected)
        return Sampled(request.session_id, request.prompt_ids, completions, segments, request.sampling, request.chat,
                       request.model, request.created, request.id)

    def answer(self, sampled: Sampled) -> dict[str, Any]:
        """The whole response object (``chat.completion`` or ``text_completion``)."""
        choices = [self.choice(sampled, i) for i in range(len(sampled.completions))]
        generated = sum(len(c.token_ids) for c in sampled.completions)
        return {"id": sampled.id, "object": "chat.completion" if sampled.chat else "text_completion",
                "created": sampled.created, "model": sampled.model, "choices": choices,
                "usage": {"prompt_tokens": len(sampled.prompt_ids), "completion_tokens": generated,
                          "total_tokens": len(sampled.prompt_ids) + generated}}

    def choice(self, sampled: Sampled, index: int) -> dict[str, Any]:
        completion = sampled.completions[index]
        text = self.text(completion, sampled.sampling)
        reason = completion.finish_reason
        if not sampled.chat:
            logprobs = None
            if sampled.sampling.logprobs:
                tokens = self.tokenizer.convert_ids_to_tokens(completion.token_ids)
                logprobs = {"tokens": tokens, "token_logprobs": list(completion.logprobs), "top_logprobs": None,
                            "text_offset": None}
            return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
        content, calls = parse_tool_calls(text)
        message = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"], reason = calls, "tool_calls"
        return {"index": index, "message": message, "finish_reason": reason,
                "logprobs": {"content": self.token_logprobs(completion)} if sampled.sampling.logprobs else None}

    def token_logprobs(self, completion: Completion) -> list[dict[str, Any]]:
        tokens = self.tokenizer.convert_ids_to_tokens(completion.token_ids)
        return [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                for t, lp in zip(tokens, completion.logprobs)]

    def text(self, completion: Completion, sampling: Sampling) -> str:
        """The completion's text: special tokens skipped, a final stop token (``stop``) left out as OpenAI does."""
        ids = completion.token_ids
        if completion.finish_reason == "stop" and ids and ids[-1] in sampling.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)
