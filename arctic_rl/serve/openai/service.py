"""``OpenAIService``: a chat or text completion request sampled through the core's ``sample`` and recorded token for
token in the ``EpisodeStore``; its answers are OpenAI's response objects (plain dicts)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from arctic_rl.errors import ConfigError
from arctic_rl.rollout.engines.base import Completion
from arctic_rl.serve.errors import RequestError
from arctic_rl.serve.openai.episodes import EpisodeStore
from arctic_rl.serve.openai.fields import (Sampling, chat_prompt, parse_tool_calls, sampling_of, session_of,
                                             text_prompt)
from arctic_rl.serve.operations import Operations


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


class OpenAIService:
    """The endpoint's logic over a core (``ServiceCore`` or ``RankedCore``) and the model's tokenizer."""

    def __init__(self, core: Operations, tokenizer, model_name: str, max_prompt_length: int, max_response_length: int):
        self.core, self.tokenizer, self.model_name = core, tokenizer, model_name
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.store = EpisodeStore()

    def sample(self, body: dict[str, Any], session_header: str | None, chat: bool) -> Sampled:
        """Check the request, render its prompt, sample ``n`` completions through the core, record them."""
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        session_id = session_of(body, session_header)
        sampling = sampling_of(body, self.tokenizer, chat)
        prompt_ids = chat_prompt(body, self.tokenizer) if chat else text_prompt(body, self.tokenizer)
        if len(prompt_ids) > self.max_prompt_length:
            raise RequestError(f"{'messages' if chat else 'prompt'}: the prompt is {len(prompt_ids)} tokens, over the "
                               f"server's sampling.max_prompt_length={self.max_prompt_length}")
        if sampling.max_tokens is not None and sampling.max_tokens > self.max_response_length:
            raise RequestError(f"max_tokens={sampling.max_tokens} is over the server's sampling.max_response_length="
                               f"{self.max_response_length}")
        out = self.core.sample([prompt_ids], n=sampling.n, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                               top_p=sampling.top_p, seed=sampling.seed, stop_token_ids=list(sampling.stop_token_ids))
        completions = out.completions[0]
        segments = self.store.record(session_id, prompt_ids, completions)
        return Sampled(session_id, prompt_ids, completions, segments, sampling, chat, self.model_name, int(time.time()),
                       f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}")

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

    def stream_chunks(self, sampled: Sampled):
        """The streamed answer's chunks: per choice, the role, then one chunk per generated token, then its end."""
        kind = "chat.completion.chunk" if sampled.chat else "text_completion"
        head = {"id": sampled.id, "object": kind, "created": sampled.created, "model": sampled.model}
        for index, completion in enumerate(sampled.completions):
            if sampled.chat:
                yield {**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
            shown = self.text(completion, sampled.sampling)
            pieces = _pieces(self.tokenizer, completion.token_ids, shown)
            for position, piece in enumerate(pieces):
                choice: dict[str, Any] = {"index": index, "finish_reason": None}
                if sampled.chat:
                    choice["delta"] = {"content": piece}
                    if sampled.sampling.logprobs:
                        choice["logprobs"] = {"content": self.token_logprobs(
                            Completion([completion.token_ids[position]], [completion.logprobs[position]], ""))}
                else:
                    choice["text"] = piece
                yield {**head, "choices": [choice]}
            end = {"index": index, "finish_reason": self.choice(sampled, index)["finish_reason"]}
            end |= {"delta": {}} if sampled.chat else {"text": ""}
            yield {**head, "choices": [end]}
        if sampled.sampling.include_usage:
            yield {**head, "choices": [], "usage": self.answer(sampled)["usage"]}


def _pieces(tokenizer, token_ids: list[int], shown: str) -> list[str]:
    """``shown`` cut at token boundaries (each piece the text one more token adds), for streaming."""
    pieces, previous = [], ""
    for i in range(len(token_ids)):
        text = tokenizer.decode(token_ids[: i + 1], skip_special_tokens=True)
        text = text if shown.startswith(text) else shown[: len(text)]
        pieces.append(text[len(previous):])
        previous = text
    if previous != shown:
        pieces.append(shown[len(previous):])
    return pieces


def openai_service(core: Operations) -> OpenAIService:
    """The service over ``core``, with the tokenizer its config names (``tokenizer``, else ``model``) and its
    sampling limits."""
    from transformers import AutoTokenizer

    config = core.config
    source = config.tokenizer or config.model
    if not isinstance(source, str):
        raise ConfigError("--api openai needs a tokenizer: set the config's tokenizer (the model is a config dict)")
    name = config.model if isinstance(config.model, str) else "arctic-rl"
    return OpenAIService(core, AutoTokenizer.from_pretrained(source), name, config.sampling.max_prompt_length,
                         config.sampling.max_response_length)
