"""The long-context multi-hop QA recipe: HotpotQA (original JSON or the hub's ``hotpotqa/hotpot_qa``)
or MuSiQue (JSONL) records packed into long-context prompts, and the GRPO task rewarding the final
answer by exact match and token F1, best over the answer aliases (``rewards/qa.py``).

    python recipes/multihop_qa/prepare.py --out recipes/multihop_qa/data [--source FILE] [--context_chars N]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from arctic_rl.errors import exit_on_config_error
from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.recipes.prepare_io import convert_records, iter_records, load_hub_split, require_records, write_jsonl
from arctic_rl.recipes.rewards.pool import SampleScorer
from arctic_rl.recipes.rewards.qa import exact_match, extract_final_answer, qa_reward

INSTRUCTION = ("Answer the question using the documents above; it needs facts from more than one of them."
               " Reason briefly, then end with a line 'Answer: <short answer>'.")


def normalise_record(record: dict) -> dict:
    """A HotpotQA (original or hub) or MuSiQue record -> ``{"id", "question", "documents": [(title,
    text)], "aliases"}``."""
    if "paragraphs" in record:  # MuSiQue
        docs = [(p["title"], p["paragraph_text"]) for p in record["paragraphs"]]
        aliases = [record["answer"], *record.get("answer_aliases", [])]
        return {"id": record["id"], "question": record["question"], "documents": docs, "aliases": aliases}
    context = record["context"]
    if isinstance(context, dict):  # the hub's HotpotQA: {"title": [...], "sentences": [[...], ...]}
        context = list(zip(context["title"], context["sentences"]))
    if not isinstance(context, list):
        raise ValueError(f"'context' must be a list of [title, sentences] pairs, got {type(context).__name__}")
    for index, item in enumerate(context):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)):
            raise ValueError(f"'context' item {index} must be a [title, [sentence, ...]] pair, got {item!r}")
    docs = [(title, "".join(sentences)) for title, sentences in context]
    return {"id": record.get("_id", record.get("id")), "question": record["question"], "documents": docs, "aliases": [record["answer"]]}


def pack_documents(documents: list[tuple[str, str]], distractors: list[tuple[str, str]], context_chars: int,
                   rng: random.Random) -> list[tuple[str, str]]:
    """The record's documents plus distractors until ``context_chars`` characters, in shuffled order."""
    packed, size = list(documents), sum(len(t) + len(x) for t, x in documents)
    titles = {t for t, _ in documents}
    for title, text in distractors:
        if size >= context_chars:
            break
        if title not in titles:
            packed.append((title, text))
            titles.add(title)
            size += len(title) + len(text)
    rng.shuffle(packed)
    return packed


def qa_prompt_rows(records: list[dict], context_chars: int = 0, seed: int = 0) -> list[dict]:
    """Prompt rows ``{"prompt", "aliases", "id"}``; each context is padded with other records'
    documents up to ``context_chars`` characters (0: the record's own documents only)."""
    rng = random.Random(seed)
    normalised = [normalise_record(r) for r in records]
    pool = [doc for r in normalised for doc in r["documents"]]
    rows = []
    for r in normalised:
        distractors = rng.sample(pool, len(pool)) if context_chars else []
        docs = pack_documents(r["documents"], distractors, context_chars, rng)
        context = "\n\n".join(f"[Document {i}] {title}\n{text}" for i, (title, text) in enumerate(docs, 1))
        rows.append({"prompt": f"{context}\n\nQuestion: {r['question']}\n{INSTRUCTION}", "aliases": r["aliases"], "id": str(r["id"])})
    return rows


def prepare(out_dir: str | Path, source: str | Path | None = None, split: str = "train",
            context_chars: int = 0, seed: int = 0) -> dict[str, int]:
    """Write ``<split>.jsonl`` under ``out_dir`` from ``source`` (a HotpotQA ``.json`` or MuSiQue
    ``.jsonl``/``.parquet`` file) or else the hub's ``hotpotqa/hotpot_qa`` distractor split. A record
    without the fields of either format is a ``ConfigError`` naming it; the previous file stays as it was."""
    labelled = require_records(iter_records(source) if source else load_hub_split("hotpotqa/hotpot_qa", "distractor", split),
                               source or "hotpotqa/hotpot_qa")
    for _ in convert_records(labelled, normalise_record):  # each record is readable, or the error names it
        pass
    rows = qa_prompt_rows([record for _, record in labelled], context_chars, seed)
    return {split: write_jsonl(rows, Path(out_dir) / f"{split}.jsonl")}


class MultiHopQAGRPO(GRPOModule):
    """GRPO on multi-hop QA: reward ``0.5 EM + 0.5 F1`` of the final ``Answer:`` line, each the best
    over the row's ``aliases``; correct = exact match with an alias. Each completion is scored in a
    worker process under a time limit (``rewards/pool.py``).

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
        self.scorer = SampleScorer(qa_reward, reward_workers, reward_timeout_s, reward_fallback)

    def reward(self, prompts: list[str], completions: list[str], aliases: list[list[str]], **columns) -> list[float]:
        return self.scorer.score(list(zip(completions, aliases)), completions)

    def is_correct(self, prompts: list[str], completions: list[str], aliases: list[list[str]], **columns) -> list[bool]:
        return [any(exact_match(extract_final_answer(c), x) for x in a) for c, a in zip(completions, aliases)]

    def teardown(self, stage: str) -> None:
        self.scorer.close()
        super().teardown(stage)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="arctic-rl prepare multihop_qa", description="Prepare multi-hop QA prompts (HotpotQA / MuSiQue) for arctic-rl.")
    parser.add_argument("--out", required=True, help="output directory (<split>.jsonl)")
    parser.add_argument("--source", help="a HotpotQA .json or MuSiQue .jsonl file; default: hotpotqa/hotpot_qa from the hub")
    parser.add_argument("--split", default="train", help="hub split to read, and the output file's name")
    parser.add_argument("--context_chars", type=int, default=0, help="pad each context with other records' documents to this many characters")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with exit_on_config_error():  # a bad input: one line naming it, exit status 2
        print(prepare(args.out, args.source, args.split, args.context_chars, args.seed))
