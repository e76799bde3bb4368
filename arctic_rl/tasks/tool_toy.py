"""A multi-turn toy whose answer only a tool knows: "say the secret digit : <tool> lookup".

Each row has a hidden ``answer`` digit that the prompt does not show. The prompt opens a tool call; the policy
closes it with ``</tool>`` (the stop token), the environment (:class:`LookupEnvironment`, a ``ToolEnvironment``
with one tool) appends ``<obs> D </obs>``, and the policy then answers. Reward: 0 without a tool call; with one,
the fraction of the first ``ANSWER_SLOTS`` words after the last observation that are the digit. Success
(``is_correct``): the first word after the last observation is the digit; guessing gets 1 in 10.

``python -m arctic_rl.tasks.tool_toy DIR`` writes the tokenizer and ``train.jsonl`` into DIR.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.rollout.environment import ToolEnvironment
from arctic_rl.tasks.toy import DIGITS, build_tokenizer, save_task

TOOL_WORDS = ("<tool>", "</tool>", "lookup", "<obs>", "</obs>", "secret")
ANSWER_SLOTS = 4
PROMPT_TEXT = "say the secret digit : <tool> lookup"


def build_tool_tokenizer():
    """The toy's word-level tokenizer plus the tool call's words (each one token)."""
    return build_tokenizer(TOOL_WORDS)


def lookup(args: str, row: dict) -> str:
    """The tool: the row's hidden digit."""
    return str(row["answer"])


class LookupEnvironment(ToolEnvironment):
    """One tool, ``lookup``; calls ``<tool> lookup </tool>``, observations ``<obs> D </obs>``."""

    tools = {"lookup": lookup}


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": PROMPT_TEXT, "answer": rng.choice(DIGITS)} for _ in range(n)]


def write_task(out_dir: str | Path, num_train: int = 256, seed: int = 0) -> Path:
    """Write ``tokenizer/`` and ``train.jsonl`` under ``out_dir``; returns it."""
    return save_task(out_dir, build_tool_tokenizer(), {"train": make_rows(num_train, seed)})


def answer_words(completion: str, answer: str) -> list[str] | None:
    """The policy's final answer: the words after the last observation, provided the tool was called
    (``</tool> <obs> D </obs>``); None when it was not (a policy that writes such an observation itself would have to
    guess the digit). After the last observation, not the first: a second call's observation is not an answer."""
    if f"</tool> <obs> {answer} </obs>" not in completion:
        return None
    return completion.rsplit("</obs>", 1)[1].split()


def lookup_score(completion: str, answer: str) -> float:
    """The fraction of the first ``ANSWER_SLOTS`` answer words that are the digit; 0 without a tool call. (No reward
    for the call itself: with one, a policy that only ever calls, every turn, is a flat optimum GRPO cannot leave.)"""
    words = answer_words(completion, answer)
    if words is None:
        return 0.0
    return sum(w == answer for w in words[:ANSWER_SLOTS]) / ANSWER_SLOTS


class SecretDigitGRPO(GRPOModule):
    """GRPO on the secret-digit tool task; correct = the first answer word is the digit."""

    def reward(self, prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
        return [lookup_score(c, a) for c, a in zip(completions, answer)]

    def is_correct(self, prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[bool]:
        return [bool((answer_words(c, a) or [None])[0] == a) for c, a in zip(completions, answer)]


if __name__ == "__main__":
    print(write_task(sys.argv[1] if len(sys.argv) > 1 else "data/tool_toy"))
