"""A toy task whose response lengths are heavy-tailed and chosen by the policy: "repeat the digit N times".

Each prompt is ``"repeat 7 n12 :"`` (a digit, then a count word ``n1`` ... ``nMAX``, among filler words). The counts
are drawn from a discrete Pareto tail (most are 1-4, a few reach ``max_count``). The reward of a completion is the
share of the first N words that are the digit, scaled down by ``overrun_penalty`` times the share of words past N
(``repeat_score``): no digit, no reward, whatever the length; the digit N times and then the end of text, 1. How long
a response is is the policy's doing, never cut from outside (beyond the length limit).

A random policy rarely ends early, so its responses run to the limit; as it learns to stop, most become short and
the large counts keep a long tail: the shape where a synchronous step waits for its longest sample
(``docs/algorithms.md``, "Asynchronous rollouts").

``python -m arctic_rl.tasks.repeat_toy DIR`` writes the tokenizer and ``train.jsonl`` / ``val.jsonl`` into DIR.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.tasks.toy import DIGITS, FILLER, build_tokenizer, save_task

MAX_COUNT = 48
OVERRUN_PENALTY = 0.5
COUNT_WORDS = tuple(f"n{i}" for i in range(1, MAX_COUNT + 1))


def repeat_tokenizer(max_count: int = MAX_COUNT):
    """The toy tokenizer with ``repeat`` and the count words ``n1`` ... ``n<max_count>``."""
    return build_tokenizer(extra_words=("repeat", *COUNT_WORDS[:max_count]))


def heavy_tailed_count(rng: random.Random, max_count: int = MAX_COUNT, alpha: float = 1.1) -> int:
    """A discrete Pareto draw in ``[1, max_count]``: P(N > n) ~ n^-alpha (about half the counts are 1-2)."""
    return min(max_count, int(1.0 / (1.0 - rng.random()) ** (1.0 / alpha)))


def make_rows(n: int, seed: int, max_count: int = MAX_COUNT) -> list[dict]:
    """``n`` prompts ``"<filler...> repeat D nN :"`` with ``answer = D`` and ``count = N``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digit, count = rng.choice(DIGITS), heavy_tailed_count(rng, max_count)
        filler = " ".join(rng.choice(FILLER[:-3]) for _ in range(rng.randint(0, 2)))
        rows.append({"prompt": f"{filler} repeat {digit} n{count} :".strip(), "answer": digit, "count": count})
    return rows


def write_task(out_dir: str | Path, num_train: int = 512, num_val: int = 64, seed: int = 0, max_count: int = MAX_COUNT) -> Path:
    """Write ``tokenizer/``, ``train.jsonl`` and ``val.jsonl`` under ``out_dir``; returns it."""
    splits = {"train": make_rows(num_train, seed, max_count), "val": make_rows(num_val, seed + 1, max_count)}
    return save_task(out_dir, repeat_tokenizer(max_count), splits)


def repeat_score(completion: str, answer: str, count: int, overrun_penalty: float = OVERRUN_PENALTY,
                 max_words: int | None = None) -> float:
    """Share of the first ``count`` words equal to ``answer``, times ``1 - overrun_penalty`` x the overrun.

    The overrun is the words past ``count`` as a share of ``count`` (at most 1). With ``max_words`` (the response's
    length limit) half of it is that, and the other half the words past ``count`` as a share of the room up to the
    limit: a response that stops anywhere before the limit then scores more than one that runs to it, which gives a
    policy that has not yet learned to count a reason to stop early."""
    words = completion.split()
    hits = sum(w == answer for w in words[:count]) / count
    excess = max(len(words) - count, 0)
    overrun = min(excess / count, 1.0)
    if max_words is not None:
        overrun = 0.5 * overrun + 0.5 * min(excess / max(max_words - count, 1), 1.0)
    return hits * (1.0 - overrun_penalty * overrun)


class RepeatDigitGRPO(GRPOModule):
    """GRPO on the repeat-the-digit task; correct = exactly the digit ``count`` times.

    Args:
        graded_stop: score the overrun against the response's length limit too (``repeat_score``'s ``max_words``).
    """

    def __init__(self, *args, graded_stop: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graded_stop = graded_stop

    def reward(self, prompts: list[str], completions: list[str], answer: list[str], count: list[int], **columns) -> list[float]:
        limit = self.options.sampling.max_response_length if self.graded_stop else None
        return [repeat_score(c, a, n, max_words=limit) for c, a, n in zip(completions, answer, count)]

    def is_correct(self, prompts: list[str], completions: list[str], answer: list[str], count: list[int], **columns) -> list[bool]:
        return [c.split() == [a] * n for c, a, n in zip(completions, answer, count)]


if __name__ == "__main__":
    print(write_task(sys.argv[1] if len(sys.argv) > 1 else "data/repeat"))
