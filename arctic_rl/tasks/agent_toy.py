"""The OpenAI agent's toy (``recipes/openai_agent``): a code that only a tool knows, found by an ordinary ``openai``-SDK
tool-calling loop (:func:`lookup_agent`) that ``fit`` runs against its OpenAI-compatible endpoint
(``model.rollout.agent``).

Each row hides a ``code`` digit. The user asks ``"code ?"``; the agent offers one tool, ``lookup``, which returns
the code. The model's reply is parsed by the endpoint: a ``<tool_call>{"name": "lookup", "arguments": {}}</tool_call>``
comes back as ``tool_calls``, the agent runs the tool and asks again with the tool's answer in the messages; the
second reply is the answer. Reward (what the agent returns): 0 without a tool call; with one, the fraction of the
first ``ANSWER_SLOTS`` words of the answer that are the code. Success (``accuracy``): the first is; guessing gets 1 in 10.

The vocabulary is a toy's: every word one token, and the whole tool call one word (``CALL``), so a random policy
writes a call now and then and the chat template re-renders it to the same token. The template ends every message
with the end-of-sequence token, so a turn that stopped there re-renders token for token and the episode grows as
one sequence (``docs/agents.md``).

``python -m arctic_rl.tasks.agent_toy DIR`` writes the tokenizer (with its chat template) and ``train.jsonl`` into DIR.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.tasks.toy import DIGITS, build_tokenizer, save_task

CALL = '<tool_call>{"name":"lookup","arguments":{}}</tool_call>'  # one word of the toy's vocabulary
WORDS = ("tool", "code", "?", CALL)
ANSWER_SLOTS = 2
PROMPT_TEXT = "code ?"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "the code",
                                           "parameters": {"type": "object", "properties": {}}}}]
# every message ends with <|endoftext|> (the end of a turn the engine samples); an assistant message renders its tool
# calls (each the word CALL), then its content
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }}{% for c in m.get('tool_calls') or [] %} <tool_call>"
    "{\"name\":\"{{ c['function']['name'] }}\",\"arguments\":{}}</tool_call>{% endfor %}"
    "{% if m['content'] %} {{ m['content'] }}{% endif %} <|endoftext|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_agent_tokenizer():
    """The special tokens, the digits and the task's words, one token each, with the chat template above."""
    tokenizer = build_tokenizer(WORDS, words=tuple(DIGITS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def lookup(row: dict) -> str:
    """The tool: the row's hidden code."""
    return str(row["code"])


def score(answer: str | None, code: str, called: bool) -> float:
    """0 without a tool call; else the fraction of the answer's first ``ANSWER_SLOTS`` words that are the code."""
    if not called:
        return 0.0
    words = (answer or "").split()
    return sum(w == code for w in words[:ANSWER_SLOTS]) / ANSWER_SLOTS


async def lookup_agent(client, row: dict) -> float:
    """A tool-calling loop as one writes it for any OpenAI-compatible server: ask, run the tools the model calls,
    ask again with their results, score the final answer. ``client``: an ``openai.AsyncOpenAI``."""
    messages = [{"role": "user", "content": row["prompt"]}]
    called = False
    for _ in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=2)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        called = True
        for call in message.tool_calls:
            json.loads(call.function.arguments)  # the tool's arguments (none here)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": lookup(row)})
    else:
        return score(None, str(row["code"]), called)  # still calling after two turns: no answer
    return score(message.content, str(row["code"]), called)


def answer_words(completion: str, code: str) -> list[str] | None:
    """The answer in an episode's decoded response (special tokens dropped): the words after the last ``assistant``
    that follows the tool's ``tool D``; None when the tool did not answer ``code``."""
    if f"tool {code} assistant" not in completion:
        return None
    return completion.rsplit("assistant", 1)[1].split()


class LookupAgentGRPO(GRPOModule):
    """GRPO on the agent toy: the reward is the agent's (``model.rollout.agent``); correct = the answer's first word is
    the code, after a call."""

    def is_correct(self, prompts: list[str], completions: list[str], code: list[str], **columns) -> list[bool]:
        return [bool((answer_words(c, str(d)) or [None])[0] == str(d)) for c, d in zip(completions, code)]


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": PROMPT_TEXT, "code": rng.choice(DIGITS)} for _ in range(n)]


def write_task(out_dir: str | Path, num_train: int = 256, seed: int = 0) -> Path:
    """Write ``tokenizer/`` and ``train.jsonl`` under ``out_dir``; returns it."""
    return save_task(out_dir, build_agent_tokenizer(), {"train": make_rows(num_train, seed)})


if __name__ == "__main__":
    print(write_task(sys.argv[1] if len(sys.argv) > 1 else "data/agent_toy"))
