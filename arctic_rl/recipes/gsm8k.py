"""The GSM8K recipe: data preparation (the hub's ``openai/gsm8k`` or the GitHub JSONL files) and the
GRPO task rewarding a correct final number (``rewards/math.py``).

    python recipes/gsm8k/prepare.py --out recipes/gsm8k/data [--source DIR_WITH_train.jsonl]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from arctic_rl.errors import ConfigError, exit_on_config_error
from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.recipes.prepare_io import Labelled, convert_records, first_existing, iter_records, load_hub_split, write_jsonl_files
from arctic_rl.recipes.rewards.pool import SampleScorer
from arctic_rl.recipes.rewards.math import gsm8k_gold, math_reward, parse_gold

INSTRUCTION = "Solve the problem step by step. End with the final answer as a number on its own line: #### <answer>"
SPLITS = ("train", "test")


def gsm8k_prompt_row(record: dict) -> dict:
    """A GSM8K record (``question``, ``answer`` ending ``#### n``) -> ``{"prompt", "answer"}`` with the
    bare gold number as ``answer``. Raises ``ValueError`` when the gold is not a number the reward reads."""
    gold = gsm8k_gold(record["answer"])
    parse_gold(gold)
    return {"prompt": f"{record['question'].strip()}\n\n{INSTRUCTION}", "answer": gold}


def split_records(source: str | Path | None, split: str) -> Iterable[Labelled]:
    """The split's labelled records: from ``source`` (a directory of the public files) or else the hub."""
    if source is None:
        return load_hub_split("openai/gsm8k", "main", split)
    if not Path(source).is_dir():
        problem = "not a directory" if Path(source).exists() else "no such directory"
        raise ConfigError(f"--source {source}: {problem}; give the directory holding GSM8K's train.jsonl and test.jsonl")
    path = first_existing(Path(source), [f"{split}.jsonl", f"{split}.parquet", f"main/{split}-00000-of-00001.parquet"])
    if path is None:
        raise ConfigError(f"--source {source}: no {split}.jsonl or {split}.parquet in it (grade_school_math/data has both splits)")
    return iter_records(path)


def prepare(out_dir: str | Path, source: str | Path | None = None) -> dict[str, int]:
    """Write ``train.jsonl`` and ``test.jsonl`` under ``out_dir``, from ``source`` (a directory with
    ``train.jsonl``/``test.jsonl`` or ``.parquet`` in the public formats) or else the hub. Both files or
    neither: a bad record is a ``ConfigError`` naming it, and the previous files stay as they were."""
    files = {f"{split}.jsonl": convert_records(split_records(source, split), gsm8k_prompt_row) for split in SPLITS}
    counts = write_jsonl_files(out_dir, files)
    return {split: counts[f"{split}.jsonl"] for split in SPLITS}


class GSM8KGRPO(GRPOModule):
    """GRPO on GSM8K: reward 1.0 when the completion's final answer (``#### n``, ``\\boxed{n}``, "the
    answer is n", else its last number) equals the gold number, else 0.0. Each completion is scored in
    a worker process under a time limit (``rewards/pool.py``), so no completion can stall a step.

    Args:
        reward_workers: worker processes scoring completions.
        reward_timeout_s: the time limit of one completion's reward, in seconds.
        reward_fallback: the reward of a completion over the limit; None: stop with an error naming
            the completion and the limit.
        **kwargs: ``GRPOModule``'s arguments.
    """

    def __init__(self, *args: Any, reward_workers: int = 2, reward_timeout_s: float = 5.0,
                 reward_fallback: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scorer = SampleScorer(math_reward, reward_workers, reward_timeout_s, reward_fallback)

    def reward(self, prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
        return self.scorer.score(list(zip(completions, answer)), completions)

    def is_correct(self, prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[bool]:
        return [r == 1.0 for r in self.reward(prompts, completions, answer)]

    def teardown(self, stage: str) -> None:
        self.scorer.close()
        super().teardown(stage)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="arctic-rl prepare gsm8k", description="Prepare GSM8K prompts for arctic-rl.")
    parser.add_argument("--out", required=True, help="output directory (train.jsonl, test.jsonl)")
    parser.add_argument("--source", help="directory of downloaded files; default: the openai/gsm8k hub dataset")
    args = parser.parse_args(argv)
    with exit_on_config_error():  # a bad input: one line naming it, exit status 2
        print(prepare(args.out, args.source))
