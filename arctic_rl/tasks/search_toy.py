"""The search agent's toy (``recipes/search_agent``): a code that only the search tool can find.

Each row hides its own small corpus, one passage per key (``"kb 7"``: key ``kb`` has code 7), drawn afresh per row,
so no code can be memorised. The prompt names a key and opens the search call: ``"code kb ? <tool> search kb"``.
The policy closes it with ``</tool>`` (the stop token), the environment (the recipe's ``SearchEnvironment``, BM25
over the row's passages, top 1) appends ``<obs> kb 7``, and the policy answers. Reward: 0 without a search;
with one, the fraction of the first ``ANSWER_SLOTS`` words after the last observation that are the code. Success
(``accuracy``): the first of them is the code; guessing gets 1 in 10. The observation has no closing tag, so the code is
the token just before the answer. What makes this toy learn in a CPU minute where ``tool_toy`` takes hundreds of
steps to pass guessing: a small vocabulary (31 tokens) and a short answer: 8 response tokens leave 4 for the answer
and only the first ``ANSWER_SLOTS`` (2) are scored, so few trained tokens carry no signal (with 12 tokens and 4 slots,
success was 0.22-0.69 after 200 steps on seeds 0-2, against 0.76-0.96 here).

``python -m arctic_rl.tasks.search_toy DIR`` writes the tokenizer and ``train.jsonl`` into DIR.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.tasks.toy import DIGITS, build_tokenizer, save_task

KEYS = ("ka", "kb", "kc", "kd")
WORDS = ("<tool>", "</tool>", "search", "answer", "<obs>", "</obs>", "code", "?") + KEYS
ANSWER_SLOTS = 2
OBSERVATION = "<obs> {}"  # no closing tag: the code is the last token before the answer
PASSAGE_WORDS = 2  # "kb 7"


def build_search_tokenizer():
    """The special tokens, the digits, the tool words and the keys, one token each."""
    return build_tokenizer(WORDS, words=tuple(DIGITS))


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        codes = {key: rng.choice(DIGITS) for key in KEYS}
        key = rng.choice(KEYS)
        rows.append({"prompt": f"code {key} ? <tool> search {key}", "aliases": [codes[key]],
                     "documents": [f"{k} {d}" for k, d in codes.items()]})
    return rows


def write_task(out_dir: str | Path, num_train: int = 256, seed: int = 0) -> Path:
    """Write ``tokenizer/`` and ``train.jsonl`` under ``out_dir``; returns it."""
    return save_task(out_dir, build_search_tokenizer(), {"train": make_rows(num_train, seed)})


def answer_words(completion: str) -> list[str] | None:
    """The words after the last observation (``<obs> KEY CODE``, the passage found), provided the search was
    called (``</tool> <obs>``); None otherwise."""
    if "</tool> <obs>" not in completion:
        return None
    return completion.rsplit("<obs>", 1)[1].split()[PASSAGE_WORDS:]


def code_score(completion: str, code: str) -> float:
    """The fraction of the first ``ANSWER_SLOTS`` answer words that are the code; 0 without a search."""
    words = answer_words(completion)
    return 0.0 if words is None else sum(w == code for w in words[:ANSWER_SLOTS]) / ANSWER_SLOTS


class SearchCodeGRPO(GRPOModule):
    """GRPO on the search toy; correct = the first answer word is the code."""

    def reward(self, prompts: list[str], completions: list[str], aliases: list[list[str]], **columns) -> list[float]:
        return [code_score(c, a[0]) for c, a in zip(completions, aliases)]

    def is_correct(self, prompts: list[str], completions: list[str], aliases: list[list[str]], **columns) -> list[bool]:
        return [(answer_words(c) or [None])[0] == a[0] for c, a in zip(completions, aliases)]


if __name__ == "__main__":
    print(write_task(sys.argv[1] if len(sys.argv) > 1 else "data/search_toy"))
