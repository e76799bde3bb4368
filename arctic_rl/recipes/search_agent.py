"""The search-agent recipe (Search-R1 style): multi-hop questions answered by a policy that searches a local BM25
index (``retriever.py``) over the multi-hop QA records' documents, with two tools:

- ``search <query>``: the ``top_k`` best passages, each cut to ``passage_chars`` characters, the observation cut to
  ``max_observation_tokens`` tokens;
- ``answer <text>``: ends the episode with reward ``em_weight x EM + (1 - em_weight) x F1`` of the text, each the
  best over the row's ``aliases`` (``rewards/qa.py``).

An episode that never calls ``answer`` scores 0. Calls are ``ToolEnvironment``'s ``<call_start> name args <stop>``;
for Qwen3 the defaults are its own one-token tags ``<tool_call>`` / ``</tool_call>`` and ``<tool_response>``.

    python recipes/search_agent/prepare.py --out recipes/search_agent/data [--source FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from arctic_rl.errors import ConfigError, exit_on_config_error
from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.recipes.multihop_qa import normalise_record
from arctic_rl.recipes.prepare_io import convert_records, iter_records, load_hub_split, require_records, write_jsonl
from arctic_rl.recipes.retriever import BM25Index, index_of, load_index
from arctic_rl.recipes.rewards.qa import answer_score, exact_match
from arctic_rl.rollout.environment import StepResult, ToolEnvironment

CALL_START, STOP, OBSERVATION = "<tool_call>", "</tool_call>", "<tool_response>\n{}\n</tool_response>"  # Qwen3's tags
INSTRUCTION = (
    "Answer the question. You cannot see any documents, but you can search a corpus of Wikipedia paragraphs:"
    " write {start} search <query> {stop} and the best passages come back. Search as often as you need (the"
    " answer usually needs facts from two paragraphs), then give a short answer: {start} answer <short answer> {stop}"
)


class SearchEnvironment(ToolEnvironment):
    """The tools ``search`` (BM25 over ``index``) and ``answer`` (scores and ends the episode).

    Args:
        tokenizer: the policy's tokenizer.
        index: a BM25 index directory written by ``prepare``; None: each row's ``documents`` column (a list of
            passages) is its own corpus (the toy, ``tasks/search_toy.py``).
        top_k: passages per search.
        passage_chars: characters of a passage at most (the rest is cut).
        max_observation_tokens: tokens of one observation at most (the result is cut to fit); keep it
            <= ``rollout.environment.max_observation_tokens``, over which an observation is a fault.
        em_weight: the answer's reward, ``em_weight x EM + (1 - em_weight) x F1``.
        call_start, stop, observation_template: ``ToolEnvironment``'s (defaults: Qwen3's tool tags).
    """

    def __init__(self, tokenizer, index: str | None = None, top_k: int = 3, passage_chars: int = 400,
                 max_observation_tokens: int = 256, em_weight: float = 0.5, call_start: str = CALL_START, stop: str = STOP,
                 observation_template: str = OBSERVATION) -> None:
        super().__init__(tokenizer, {"search": self.search, "answer": self.answer}, call_start, stop, observation_template)
        if observation_template.count("{}") != 1:
            raise ConfigError(f"model.rollout.environment.env_args.observation_template must hold one '{{}}', got {observation_template!r}")
        self.index = None if index is None else load_index(str(index))
        self.top_k, self.passage_chars, self.em_weight = top_k, passage_chars, em_weight
        head, tail = observation_template.split("{}")
        self.head_ids, self.tail_ids = self.encode(head), self.encode(tail)
        self.result_tokens = max_observation_tokens - len(self.head_ids) - len(self.tail_ids)
        if self.result_tokens < 1:
            raise ConfigError(f"model.rollout.environment.env_args.max_observation_tokens {max_observation_tokens} leaves no"
                              f" room for a result inside {observation_template!r}")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def search(self, args: str, row: dict) -> str:
        """The best passages for query ``args``, best first, one a line."""
        index = self.index or index_of(tuple(row["documents"]))
        found = index.search(args, self.top_k)
        if not found:
            return "no results"
        return "\n".join(p[:self.passage_chars] for p in found)

    def answer(self, args: str, row: dict) -> StepResult:
        """The final answer: the episode ends with its reward."""
        return StepResult([], reward=answer_score(args, list(row["aliases"]), self.em_weight), done=True,
                          info={"tool": "answer", "answer": args})

    def observe(self, result: str) -> list[int]:
        """``observation_template`` around ``result``, the result's tokens cut to fit ``max_observation_tokens``:
        the template's head and tail and the result are tokenized once each and concatenated."""
        return self.head_ids + self.encode(result.strip())[:self.result_tokens] + self.tail_ids


def submitted_answer(completion: str, call_start: str = CALL_START, stop: str = STOP) -> str | None:
    """The text of the completion's last ``answer`` call (``<call_start> answer TEXT <stop>``), None without one."""
    body, _, after = completion.rpartition(stop)
    if not _ or after.strip():  # the answer call ends the episode: nothing follows it
        return None
    words = body.rsplit(call_start, 1)[-1].strip().split(maxsplit=1) if call_start in body else []
    if not words or words[0] != "answer":
        return None
    return words[1].strip() if len(words) > 1 else ""


class SearchAgentGRPO(GRPOModule):
    """GRPO of a search agent: the environment's ``answer`` reward alone (``reward`` is not overridden); correct = the
    submitted answer matches an alias exactly.

    Args:
        call_start: the tag that opens a call, as in ``env_args`` (to read the submitted answer for ``accuracy``).
        stop: the tag that closes it.
        **kwargs: ``GRPOModule``'s arguments.
    """

    def __init__(self, *args: Any, call_start: str = CALL_START, stop: str = STOP, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.call_start, self.stop = call_start, stop

    def is_correct(self, prompts: list[str], completions: list[str], aliases: list[list[str]], **columns) -> list[bool]:
        answers = [submitted_answer(c, self.call_start, self.stop) for c in completions]
        return [a is not None and any(exact_match(a, x) for x in al) for a, al in zip(answers, aliases)]


def passages_of(record: dict) -> list[str]:
    """A normalised record's documents as passages ``"title: text"``."""
    return [f"{title}: {text}".strip() for title, text in record["documents"]]


def prepare(out_dir: str | Path, source: str | Path | None = None, split: str = "train", call_start: str = CALL_START,
            stop: str = STOP) -> dict[str, int]:
    """Write ``<split>.jsonl`` (``{"prompt", "aliases", "id"}``: the question and the tool instructions, no
    documents) and ``index/`` (BM25 over every record's documents, each title once) under ``out_dir``, from
    ``source`` (a HotpotQA ``.json`` or MuSiQue ``.jsonl``/``.parquet`` file) or else the hub's ``hotpotqa/hotpot_qa``
    distractor split. A bad record is a ``ConfigError`` naming it, before anything is written."""
    labelled = require_records(iter_records(source) if source else load_hub_split("hotpotqa/hotpot_qa", "distractor", split),
                               source or "hotpotqa/hotpot_qa")
    records = list(convert_records(labelled, normalise_record))
    corpus: dict[str, str] = {}
    for record in records:
        for title, passage in zip((t for t, _ in record["documents"]), passages_of(record)):
            corpus.setdefault(title, passage)
    instruction = INSTRUCTION.format(start=call_start, stop=stop)
    rows = [{"prompt": f"{instruction}\n\nQuestion: {r['question']}", "aliases": r["aliases"], "id": str(r["id"])} for r in records]
    BM25Index(list(corpus.values())).save(Path(out_dir) / "index")
    return {split: write_jsonl(rows, Path(out_dir) / f"{split}.jsonl"), "passages": len(corpus)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="arctic-rl prepare search_agent",
                                     description="Prepare search-agent questions and the BM25 index of their documents.")
    parser.add_argument("--out", required=True, help="output directory (<split>.jsonl and index/)")
    parser.add_argument("--source", help="a HotpotQA .json or MuSiQue .jsonl file; default: hotpotqa/hotpot_qa from the hub")
    parser.add_argument("--split", default="train", help="hub split to read, and the output file's name")
    parser.add_argument("--call_start", default=CALL_START, help="the tag opening a call, in the prompt's instructions")
    parser.add_argument("--stop", default=STOP, help="the tag closing a call")
    args = parser.parse_args(argv)
    with exit_on_config_error():  # a bad input: one line naming it, exit status 2
        print(prepare(args.out, args.source, args.split, args.call_start, args.stop))
