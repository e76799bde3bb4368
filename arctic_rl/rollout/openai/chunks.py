"""The chunks of a streamed OpenAI answer (``chat.completion.chunk`` or ``text_completion`` objects), built as the
tokens come: per choice the role first (chat), then one chunk per generated token (the text it settles, its log-prob),
then the choice's end; the usage last when asked. Tokens come from the engine's decode steps while it samples
(``live.py``), or all at the end from the recorded completions (an engine that answers whole); both end the same way.

Text: each chunk carries what decoding the choice's tokens so far adds to the text already sent, holding back what a
later token may still change (trailing whitespace, which a tokenizer's clean-up may drop before punctuation, and the
replacement character of a character split between tokens); at the end the rest of the completion's whole text is
sent, so the deltas add up to the text a non-streamed answer carries.

Tool calls (chat): content deltas stop where a ``<tool_call>`` begins (and hold back a tail that may be its start);
at the end the answer's parsed calls follow as one ``tool_calls`` delta (index, id, type, name, arguments) and the
choice ends with ``tool_calls``, so the deltas add up to the non-streamed message: its content and its calls. A call
that does not parse stays content, as in the non-streamed message, and is sent at the end."""

from __future__ import annotations

import logging
import re
from typing import Any

from arctic_rl.rollout.engines.base import Completion, DecodeStep
from arctic_rl.rollout.openai.fields import TOOL_CALL_OPEN
from arctic_rl.rollout.openai.service import CompletionRequest, OpenAIService, Sampled

logger = logging.getLogger(__name__)
UNSETTLED = re.compile(r"[\s\ufffd]+$")  # text a later token may still change


class _Choice:
    """What one choice has streamed: its tokens, and the text sent for them."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.sent = ""


class StreamChunks:
    """The chunks of one request's streamed answer (see the module docstring)."""

    def __init__(self, service: OpenAIService, request: CompletionRequest) -> None:
        self.service, self.request = service, request
        kind = "chat.completion.chunk" if request.chat else "text_completion"
        self.head = {"id": request.id, "object": kind, "created": request.created, "model": request.model}
        self.choices = [_Choice() for _ in range(request.sampling.n)]

    def start(self) -> list[dict[str, Any]]:
        """Chat: each choice's role (and empty content); text completions start with their first token."""
        if not self.request.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
                for i in range(len(self.choices))]

    def step(self, step: DecodeStep) -> list[dict[str, Any]]:
        """A chunk per token one decode step added (row ``k`` of the engine's call is choice ``k``)."""
        return [self._token(index, token, logprob) for index, (tokens, logprobs) in enumerate(zip(step.token_ids, step.logprobs))
                for token, logprob in zip(tokens, logprobs)]

    def end(self, sampled: Sampled) -> list[dict[str, Any]]:
        """Per choice: the recorded tokens not streamed yet (all of them when the engine answered whole), the rest of
        its text, its finish reason; then the usage (``stream_options.include_usage``)."""
        chunks = []
        for index, completion in enumerate(sampled.completions):
            choice = self.choices[index]
            told = len(choice.token_ids)
            if completion.token_ids[:told] != choice.token_ids:
                logger.error("choice %d of %s: the streamed tokens %s are not the start of the recorded completion %s",
                             index, sampled.id, choice.token_ids, completion.token_ids)
            chunks += [self._token(index, t, lp) for t, lp in zip(completion.token_ids[told:], completion.logprobs[told:])]
            whole = self.service.choice(sampled, index)  # the non-streamed choice: its text, calls and finish reason
            calls = whole["message"].get("tool_calls") if sampled.chat else None
            shown = (whole["message"]["content"] or "") if calls else self.service.text(completion, sampled.sampling)
            if shown.startswith(choice.sent):
                if len(shown) > len(choice.sent):
                    chunks.append(self._chunk(self._text(index, shown[len(choice.sent):])))
            else:  # a tokenizer whose decoding of a prefix is not a prefix of the whole decoding (sent; cannot be taken back)
                logger.warning("choice %d of %s: the streamed text %r is not the start of the completion's text %r",
                               index, sampled.id, choice.sent, shown)
            if calls:
                delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
                chunks.append(self._chunk({"index": index, "delta": delta, "finish_reason": None}))
            chunks.append(self._chunk({"index": index, "finish_reason": whole["finish_reason"]} | ({"delta": {}} if sampled.chat else {"text": ""})))
        if sampled.sampling.include_usage:
            chunks.append({**self.head, "choices": [], "usage": self.service.answer(sampled)["usage"]})
        return chunks

    def _token(self, index: int, token: int, logprob: float) -> dict[str, Any]:
        """The chunk of one more token of choice ``index``: the text it settles (none for a ``stop`` token, which
        ends the choice and is not shown), and its log-prob when asked (chat)."""
        choice, sampling = self.choices[index], self.request.sampling
        choice.token_ids.append(token)
        piece = ""
        if token not in sampling.stop_token_ids:
            settled = self.service.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
            if self.request.chat:
                settled = before_tool_call(settled)
            settled = UNSETTLED.sub("", settled)
            if settled.startswith(choice.sent):
                piece, choice.sent = settled[len(choice.sent):], settled
        chunk = self._text(index, piece)
        if self.request.chat and sampling.logprobs:
            chunk["logprobs"] = {"content": self.service.token_logprobs(Completion([token], [logprob], ""))}
        return self._chunk(chunk)

    def _text(self, index: int, text: str) -> dict[str, Any]:
        if self.request.chat:
            return {"index": index, "delta": {"content": text}, "finish_reason": None}
        return {"index": index, "text": text, "finish_reason": None}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "choices": [choice]}


def before_tool_call(text: str) -> str:
    """``text`` up to its first ``<tool_call>``, or without a tail that may still become one (``"... <tool"``)."""
    at = text.find(TOOL_CALL_OPEN)
    if at >= 0:
        return text[:at]
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:size]):
            return text[:-size]
    return text
