"""The multi-hop QA recipe: HotpotQA and MuSiQue records into long-context prompts, and the smoke
config end to end on CPU."""

import json
import random
from pathlib import Path

import pytest

from arctic_rl.recipes.multihop_qa import MultiHopQAGRPO, normalise_record, pack_documents, prepare, qa_prompt_rows
from arctic_rl.recipes.prepare_io import read_records
from tests.helpers import REPO
from tests.recipes.recipe_smoke import smoke_config

FIXTURES = Path(__file__).parent / "fixtures/multihop_qa"
HOTPOT, MUSIQUE = FIXTURES / "hotpot_train_v1.1.json", FIXTURES / "musique_ans_v1.0_train.jsonl"


def test_hotpot_original_hub_and_musique_records_normalise_alike():
    original = read_records(HOTPOT)[0]
    hub = {"id": original["_id"], "question": original["question"], "answer": original["answer"],
           "context": {"title": [t for t, _ in original["context"]], "sentences": [s for _, s in original["context"]]}}
    assert normalise_record(hub) == normalise_record(original)
    assert normalise_record(original)["documents"][0] == ("The Salt Road (novel)", "The Salt Road is a 1998 novel. It was written by Mira Kovar.")
    musique = normalise_record(read_records(MUSIQUE)[0])
    assert musique["aliases"] == ["Austin, Texas", "Austin", "Austin, TX"] and len(musique["documents"]) == 3


def test_contexts_are_padded_with_other_documents_and_keep_their_own():
    docs, others = [("A", "a" * 10)], [("B", "b" * 10), ("A", "dup"), ("C", "c" * 10), ("D", "d" * 10)]
    packed = pack_documents(docs, others, context_chars=25, rng=random.Random(0))
    assert sorted(t for t, _ in packed) == ["A", "B", "C"]
    rows = qa_prompt_rows(read_records(HOTPOT), context_chars=2000)
    assert all(r["prompt"].count("[Document") > 5 for r in rows)
    assert "Vltava flows" in rows[0]["prompt"] and rows[0]["aliases"] == ["Vltava"]


def test_reward_and_correctness_use_the_final_answer_line():
    completions = ["Kovar was born in Prague.\nAnswer: the Vltava", "Answer: Vltava river", "Answer: Danube"]
    aliases = [["Vltava"]] * 3
    module = MultiHopQAGRPO(model={"model_type": "qwen3"}, tokenizer=str(REPO / "data/toy/tokenizer"), reward_workers=1)
    try:
        assert module.reward([""] * 3, completions, aliases) == pytest.approx([1.0, 0.5 * 2 / 3, 0.0])
        assert module.is_correct([""] * 3, completions, aliases) == [True, False, False]
    finally:
        module.teardown("fit")


def smoke_setup(root: Path) -> dict:
    """The HotpotQA fixture prepared, the smoke config on it (``recipe_smokes`` fits it)."""
    prepared = prepare(root / "data", HOTPOT, context_chars=2000)
    return {"config": smoke_config("multihop_qa", root / "data/train.jsonl", root / "run"), "root": root / "run",
            "prepared": prepared}


@pytest.mark.slow
def test_prepare_then_fit_the_smoke_config(recipe_smokes, tmp_path):
    smoke = recipe_smokes["multihop_qa"]
    assert smoke.setup["prepared"] == {"train": 4}
    assert prepare(tmp_path / "musique", MUSIQUE) == {"train": 2}
    row = json.loads((tmp_path / "musique/train.jsonl").read_text().splitlines()[0])
    assert row["aliases"] == ["Austin, Texas", "Austin", "Austin, TX"]
    metrics = smoke.rows()
    assert all(0.0 <= float(m["reward"]) <= 1.0 for m in metrics) and all(m["accuracy"] for m in metrics)
