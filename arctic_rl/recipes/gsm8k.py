"""The GSM8K recipe: data preparation (the hub's ``openai/gsm8k`` or the GitHub JSONL files) and the
GRPO task rewarding a correct final number (``rewards/math.py``).

    python recipes/gsm8k/prepare.py --out recipes/gsm8k/data [--source DIR_WITH_train.jsonl]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.recipes.prepare_io import first_existing, load_hub_split, read_records, write_jsonl
from arctic_rl.recipes.rewards.math import gsm8k_gold, math_reward

INSTRUCTION = "Solve the problem step by step. End with the final answer as a number on its own line: #### <answer>"
SPLITS = ("train", "test")


def gsm8k_prompt_row(record: dict) -> dict:
    """A GSM8K record (``question``, ``answer`` ending ``#### n``) -> ``{"prompt", "answer"}`` with the
    bare gold number as ``answer``."""
    return {"prompt": f"{record['question'].strip()}\n\n{INSTRUCTION}", "answer": gsm8k_gold(record["answer"])}


def prepare(out_dir: str | Path, source: str | Path | None = None) -> dict[str, int]:
    """Write ``train.jsonl`` and ``test.jsonl`` under ``out_dir``, from ``source`` (a directory with
    ``train.jsonl``/``test.jsonl`` or ``.parquet`` in the public formats) or else the hub."""
    counts = {}
    for split in SPLITS:
        if source is None:
            records = load_hub_split("openai/gsm8k", "main", split)
        else:
            path = first_existing(Path(source), [f"{split}.jsonl", f"{split}.parquet", f"main/{split}-00000-of-00001.parquet"])
            if path is None:
                raise SystemExit(f"{source}: no {split}.jsonl or {split}.parquet")
            records = read_records(path)
        counts[split] = write_jsonl((gsm8k_prompt_row(r) for r in records), Path(out_dir) / f"{split}.jsonl")
    return counts


class GSM8KGRPO(GRPOModule):
    """GRPO on GSM8K: reward 1.0 when the completion's final answer (``#### n``, ``\\boxed{n}``, "the
    answer is n", else its last number) equals the gold number, else 0.0."""

    def reward(self, prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[float]:
        return [math_reward(c, a) for c, a in zip(completions, answer)]

    def is_correct(self, prompts: list[str], completions: list[str], answer: list[str], **columns) -> list[bool]:
        return [r == 1.0 for r in self.reward(prompts, completions, answer)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="arctic-rl prepare gsm8k", description="Prepare GSM8K prompts for arctic-rl.")
    parser.add_argument("--out", required=True, help="output directory (train.jsonl, test.jsonl)")
    parser.add_argument("--source", help="directory of downloaded files; default: the openai/gsm8k hub dataset")
    args = parser.parse_args(argv)
    print(prepare(args.out, args.source))
