"""What a chat or text completion request asks for, checked field by field (a ``RequestError`` naming the field), and
the prompt it becomes: chat messages rendered once through the model's chat template (tools included), a text prompt
tokenized without one. Also reads tool calls back out of generated text."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from arctic_rl.errors import RequestError
from arctic_rl.rollout.openai.episodes import check_session_id

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)  # the Hermes / Qwen form chat templates teach
REFUSED_FIELDS = {  # asked for, not offered: refused rather than silently ignored
    "top_logprobs": "only the sampled token's log-prob is recorded",
    "logit_bias": "it would change the sampled distribution the log-probs are recorded from",
    "presence_penalty": "it would change the sampled distribution the log-probs are recorded from",
    "frequency_penalty": "it would change the sampled distribution the log-probs are recorded from",
    "response_format": "constrained decoding is not offered", "functions": "use tools", "best_of": "not offered",
    "echo": "not offered", "suffix": "not offered",
}

SAMPLING_FIELDS = {"model", "user", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "stream",
                   "stream_options"}
# accepted and without effect here: one model is served (``model`` is not checked); ``parallel_tool_calls``: every
# call the model writes is returned; ``metadata`` / ``store``: nothing is stored but the episode
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "tools", "tool_choice", "max_completion_tokens", "parallel_tool_calls",
                                 "metadata", "store"}
TEXT_FIELDS = SAMPLING_FIELDS | {"prompt"}


@dataclass(frozen=True)
class Sampling:
    """The sampling fields of a request, checked."""

    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop_token_ids: tuple[int, ...]
    logprobs: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


def session_of(body: dict[str, Any], header: str | None) -> str:
    """The session id: the ``X-Session-Id`` header, else the ``user`` field (they must agree when both are set)."""
    user = body.get("user")
    if header is not None and user is not None and header != user:
        raise RequestError(f"X-Session-Id {header!r} and user {user!r} name different sessions; send one")
    if header is None and user is None:
        raise RequestError("a session id is required: the X-Session-Id header or the user field (one per episode)")
    return check_session_id(header if header is not None else user, "X-Session-Id" if header is not None else "user")


def sampling_of(body: dict[str, Any], tokenizer, chat: bool) -> Sampling:
    """The request's sampling fields; a field this endpoint does not know, or one that would change or hide what is
    recorded, is refused (nothing is silently dropped)."""
    unknown = set(body) - (CHAT_FIELDS if chat else TEXT_FIELDS) - set(REFUSED_FIELDS)
    if unknown:
        raise RequestError(f"{sorted(unknown)[0]}: not a field this endpoint takes (fields: "
                           f"{sorted(CHAT_FIELDS if chat else TEXT_FIELDS)}; docs/agents.md)")
    for name, why in REFUSED_FIELDS.items():
        if body.get(name) not in (None, 0, False):
            raise RequestError(f"{name} is not supported: {why}")
    n = _integer(body, "n", 1, low=1)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        max_tokens = _integer({"max_tokens": max_tokens}, "max_tokens", None, low=1)
    temperature, top_p = _number(body, "temperature", 1.0), _number(body, "top_p", 1.0)
    if not 0 <= temperature <= 2:
        raise RequestError(f"temperature must be in [0, 2], got {temperature}")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    seed = None if body.get("seed") is None else _integer(body, "seed", None)
    logprobs = body.get("logprobs")
    if chat and logprobs not in (None, True, False):
        raise RequestError(f"logprobs must be true or false, got {logprobs!r}")
    if not chat and logprobs not in (None, 0, 1, True, False) :
        raise RequestError(f"logprobs: only the sampled token's log-prob is offered (0 or 1), got {logprobs!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} or options.get("include_usage", False) not in (True, False):
        raise RequestError(f"stream_options: only {{'include_usage': true|false}} is supported, got {options!r}")
    return Sampling(n, max_tokens, temperature, top_p, seed, _stop_token_ids(body.get("stop"), tokenizer),
                    bool(logprobs), stream, bool(options.get("include_usage", False)))


def chat_prompt(body: dict[str, Any], tokenizer) -> list[int]:
    """The prompt token ids of a chat request: its messages (and tools) through the tokenizer's chat template, once."""
    messages, tools = body.get("messages"), body.get("tools")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of messages")
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    if tools is not None and (not isinstance(tools, list) or not all(_is_tool(t) for t in tools)):
        raise RequestError("tools must be a list of {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise RequestError(f"tool_choice {body['tool_choice']!r} is not supported (auto or none)")
    try:
        ids = tokenizer.apply_chat_template(rendered, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    except Exception as e:  # noqa: BLE001  (a template's own error is about the request)
        raise RequestError(f"messages: the chat template cannot render them: {type(e).__name__}: {e}") from None
    return [int(t) for t in (ids["input_ids"] if isinstance(ids, dict) else ids)]


def text_prompt(body: dict[str, Any], tokenizer) -> list[int]:
    """The prompt token ids of a text completion: one string (tokenized, no template) or one list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt, add_special_tokens=False)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < len(tokenizer) for t in prompt):
            raise RequestError(f"prompt: token ids must be in [0, {len(tokenizer)})")
        return list(prompt)
    raise RequestError("prompt must be one non-empty string or one non-empty list of token ids (one prompt per request)")


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``text`` split into its content and the ``<tool_call>{"name", "arguments"}</tool_call>`` calls in it; a call
    whose body is not such JSON stays in the content (it is what the model wrote)."""
    calls, kept = [], text
    for i, match in enumerate(TOOL_CALL.finditer(text)):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{i}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(arguments)}})
        kept = kept.replace(match.group(0), "", 1)
    return (kept.strip() if calls else text), calls


def _message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object with role and content")
    role = message.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f"{where}.content: only text parts are supported ({{'type': 'text', 'text': ...}})")
        content = "".join(p["text"] for p in content)
    if content is None and not (role == "assistant" and message.get("tool_calls")):
        raise RequestError(f"{where}.content is missing")
    if content is not None and not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text parts")
    out: dict[str, Any] = {"role": role, "content": content or ""}
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise RequestError(f"{where}.tool_call_id is missing (a tool message answers a call by its id)")
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("tool_calls") is not None:
        if role != "assistant" or not isinstance(message["tool_calls"], list):
            raise RequestError(f"{where}.tool_calls: only an assistant message carries a list of tool calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(message["tool_calls"])]
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"{where}.function.name is missing")
    try:
        arguments = json.loads(function.get("arguments", "{}"))
    except (TypeError, ValueError) as e:
        raise RequestError(f"{where}.function.arguments is not JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object")
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _is_tool(tool: Any) -> bool:
    return (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("function"), dict)
            and isinstance(tool["function"].get("name"), str))


def _stop_token_ids(stop: Any, tokenizer) -> tuple[int, ...]:
    """``stop`` strings as token ids: each must be exactly one token (the engine stops on tokens, and a completion
    cut inside a token could not be recorded exactly)."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise RequestError("stop must be a string or a list of up to 4 non-empty strings")
    ids = []
    for s in stops:
        encoded = tokenizer.encode(s, add_special_tokens=False)
        if len(encoded) != 1:
            raise RequestError(f"stop {s!r} is {len(encoded)} tokens; only a stop string that is one token is supported")
        ids.append(encoded[0])
    return tuple(ids)


def _integer(body: dict[str, Any], name: str, default: int | None, low: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        raise RequestError(f"{name} must be an integer{f' >= {low}' if low is not None else ''}, got {value!r}")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    value = default if value is None else value
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)
