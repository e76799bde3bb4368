"""The transformers engine's batched decoder (``engines/transformers/decode.py``, ``sampling.py``), on CPU with the tiny
Qwen3: one batch of prompts of different lengths, shared prefill, compaction of finished rows. Each is checked
against the plain computation: the model's own forward for log-probs, one prompt at a time for samples."""

import pytest
import torch

from arctic_rl.modules.models import build_causal_lm, response_logprobs
from arctic_rl.rollout.engines.base import SamplingConfig
from arctic_rl.rollout.engines.transformers.engine import TransformersEngine
from arctic_rl.rollout.engines.transformers.sampling import sample_tokens, uniform_table

PROMPTS = ["echo 7 :", "the say x echo 6 : 1 2", "x 3", "say echo echo 4 : x the say 9"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = TransformersEngine(str(tiny_model_dir))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def frequent_eos(engine, tokenizer):
    """A token the tiny random model samples often, made the engine's stop token for a test, so that rows
    finish at many different steps (its real EOS almost never comes). Restored afterwards."""
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    outputs = engine.generate(prompt_ids, SamplingConfig(n=4, max_tokens=24, seed=3))
    counts = torch.bincount(torch.tensor([t for o in outputs for c in o for t in c.token_ids]))
    return int(counts.argmax())


def _with_eos(engine, eos):
    original = (engine.eos_id, engine.decoder.eos_id)
    engine.eos_id = engine.decoder.eos_id = eos
    return original


def test_prompts_of_different_lengths_sample_as_each_prompt_alone(engine, tokenizer):
    """One left-padded batch (padding masked out) gives each prompt exactly its samples alone with its seeds."""
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len({len(p) for p in prompt_ids}) == len(PROMPTS)
    seeds = (101, 102, 103, 104)
    together = engine.generate(prompt_ids, SamplingConfig(n=3, max_tokens=10, prompt_seeds=seeds, temperature=1.3))
    for ids, seed, got in zip(prompt_ids, seeds, together):
        alone = engine.generate([ids], SamplingConfig(n=3, max_tokens=10, prompt_seeds=(seed,), temperature=1.3))[0]
        assert [c.token_ids for c in got] == [c.token_ids for c in alone]
        for a, b in zip(got, alone):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_compaction_of_finished_rows_changes_no_sample(engine, tokenizer, frequent_eos):
    """Rows that stop early are compacted out (check every step, down to 1 row); the samples and
    log-probs equal a decode that never compacts, and the log-probs equal the model's own forward."""
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    sampling = SamplingConfig(n=4, max_tokens=24, seed=7)
    original = _with_eos(engine, frequent_eos)
    dec = engine.decoder
    try:
        dec.check_every, dec.min_rows = 10**6, 1
        plain = engine.generate(prompt_ids, sampling)
        dec.check_every = 1
        compacted = engine.generate(prompt_ids, sampling)
    finally:
        engine.eos_id, dec.eos_id = original
        dec.check_every, dec.min_rows = 8, 8
    lengths = sorted(len(c.token_ids) for o in plain for c in o)
    assert lengths[0] < lengths[-1] and sum(c.finish_reason == "stop" for o in plain for c in o) >= 8  # rows did finish early
    assert [c.token_ids for o in compacted for c in o] == [c.token_ids for o in plain for c in o]
    assert [c.finish_reason for o in compacted for c in o] == [c.finish_reason for o in plain for c in o]
    for a, b in zip((c for o in compacted for c in o), (c for o in plain for c in o)):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    _assert_logprobs_are_the_models(engine, tokenizer, prompt_ids, compacted)


def _assert_logprobs_are_the_models(engine, tokenizer, prompt_ids, outputs):
    policy = build_causal_lm(str(engine.model.config._name_or_path), "float32").eval()
    flat = [c for o in outputs for c in o]
    r = max(len(c.token_ids) for c in flat)
    ids, mask, sampler = torch.full((len(flat), r), tokenizer.pad_token_id), torch.zeros(len(flat), r), torch.zeros(len(flat), r)
    for i, c in enumerate(flat):
        ids[i, : len(c.token_ids)], mask[i, : len(c.token_ids)] = torch.tensor(c.token_ids), 1
        sampler[i, : len(c.token_ids)] = torch.tensor(c.logprobs)
    prompts = [p for p in prompt_ids for _ in outputs[0]]
    with torch.no_grad():
        ours, _ = response_logprobs(policy, prompts, ids, mask, 1.0, False, tokenizer.pad_token_id)
    assert ((ours - sampler) * mask).abs().max().item() < 1e-4


def test_a_sample_depends_only_on_its_own_seed(engine, tokenizer):
    """The same (prompt, seed) in calls with different neighbours, positions and n gives the same sample."""
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    first = engine.generate([ids[1], ids[0]], SamplingConfig(n=2, max_tokens=8, prompt_seeds=(5, 9)))
    second = engine.generate([ids[3], ids[2], ids[0], ids[1]], SamplingConfig(n=2, max_tokens=8, prompt_seeds=(1, 2, 9, 5)))
    assert [c.token_ids for c in first[0]] == [c.token_ids for c in second[3]]
    assert [c.token_ids for c in first[1]] == [c.token_ids for c in second[2]]
    assert [c.token_ids for c in first[0]] != [c.token_ids for c in first[1]]


def test_asleep_engine_refuses_to_generate_and_wakes_with_its_weights(engine, tokenizer):
    ids = [tokenizer("echo 7 :")["input_ids"]]
    before = engine.generate(ids, SamplingConfig(n=2, max_tokens=6, seed=1))
    engine.sleep()
    with pytest.raises(RuntimeError, match="while asleep: call wake_up"):
        engine.generate(ids, SamplingConfig(n=2, max_tokens=6, seed=1))
    engine.wake_up()
    after = engine.generate(ids, SamplingConfig(n=2, max_tokens=6, seed=1))
    assert [c.token_ids for c in after[0]] == [c.token_ids for c in before[0]]


def test_empty_prompt_is_refused_naming_it(engine, tokenizer):
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        engine.generate([tokenizer("x 3")["input_ids"], []], SamplingConfig(n=1, max_tokens=2))


def test_inverse_cdf_sampling_follows_temperature_and_top_p():
    """``sample_tokens`` on a known distribution: the fraction of each token over many uniforms equals its
    probability after temperature and the top-p cut, and zero-probability tokens never come."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]]))
    u = uniform_table([42], 1, 20000, torch.device("cpu"))[0]
    for temperature, top_p, expected in [
        (1.0, 1.0, [0.5, 0.3, 0.15, 0.05, 0.0]),
        (0.5, 1.0, [25 / 36.5, 9 / 36.5, 2.25 / 36.5, 0.25 / 36.5, 0.0]),
        (1.0, 0.7, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0, 0.0]),  # cut: the nucleus is the first two (0.5 + 0.3 >= 0.7)
    ]:
        tokens, logprobs = sample_tokens(logits.expand(len(u), 5), u, temperature, top_p)
        freq = torch.bincount(tokens, minlength=5).double() / len(u)
        assert freq.tolist() == pytest.approx(expected, abs=0.012)
        scaled = torch.log_softmax(logits[0] / temperature, -1)
        assert torch.equal(logprobs, scaled[tokens])  # log-probs before the cut, at the temperature


def test_uniform_rows_come_from_their_own_seeds():
    table = uniform_table([7, 8, 7], 3, 5, torch.device("cpu"))
    assert torch.equal(table[0], table[2]) and not torch.equal(table[0], table[1])
    assert torch.equal(table[1], torch.rand(5, generator=torch.Generator().manual_seed(8), dtype=torch.float64))
    with pytest.raises(ValueError, match="2 seeds for 3 rows"):
        uniform_table([1, 2], 3, 5, torch.device("cpu"))


def test_decode_attention_equals_transformers_sdpa_with_repeated_heads():
    """The engine's one-token GQA attention (query heads grouped per key/value head) equals transformers'
    SDPA attention, which repeats the key/value heads, under a padding mask."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from arctic_rl.rollout.engines.transformers.attention import decode_sdpa

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, length, 16, generator=g, dtype=torch.float64) for h, length in [(8, 1), (2, 11), (2, 11)])
    mask = torch.rand(3, 1, 1, 11, generator=g) > 0.3
    mask[:, ..., -1] = True
    module = SimpleNamespace(num_key_value_groups=4, is_causal=True, training=False)
    ours, _ = decode_sdpa(module, q, k, v, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert ours.shape == theirs.shape == (3, 1, 8, 16)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_rows_that_all_finish_before_a_check_keep_their_tokens(engine, tokenizer):
    """Every row stopped by the first finished-row check (every token a stop token: one token each, max_tokens well
    past ``check_every``): their samples are kept, each the first token of the same seed's unstopped sample. (The
    decoder used to end there without saving them: every row came back as padding with log-prob 0.)"""
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    free = engine.generate(prompt_ids, SamplingConfig(n=4, max_tokens=20, seed=9))
    everything = tuple(range(len(tokenizer)))
    stopped = engine.generate(prompt_ids, SamplingConfig(n=4, max_tokens=20, seed=9, stop_token_ids=everything))
    for per_free, per_stopped in zip(free, stopped):
        for f, s in zip(per_free, per_stopped):
            assert (s.token_ids, s.finish_reason) == (f.token_ids[:1], "stop")
            assert s.logprobs == pytest.approx(f.logprobs[:1], abs=1e-5) and s.logprobs[0] < 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_one_to_three_new_tokens_decode(engine, tokenizer, max_tokens):
    """A multi-turn episode's last turn may have 1-3 tokens of budget left (the attention window's chunk size used to
    be ``1 << log2(max_tokens / 4)``: a negative shift)."""
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    out = engine.generate(prompt_ids, SamplingConfig(n=2, max_tokens=max_tokens, seed=4))
    longer = engine.generate(prompt_ids, SamplingConfig(n=2, max_tokens=8, seed=4))
    for per_prompt, per_longer in zip(out, longer):
        for c, full in zip(per_prompt, per_longer):
            assert 1 <= len(c.token_ids) <= max_tokens and c.token_ids == full.token_ids[: len(c.token_ids)]


class StepRecorder:
    """A ``DecodeListener`` that keeps the steps it is told, and wants the call to stop once it has ``stop_after``."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.steps, self.stop_after = [], stop_after

    def on_step(self, step) -> None:
        self.steps.append(step)

    def wants_stop(self) -> bool:
        return self.stop_after is not None and len(self.steps) >= self.stop_after


def test_streamed_steps_add_up_to_the_completions_and_a_stop_cuts_every_row_there(engine, tokenizer, frequent_eos):
    """``generate_streamed`` tells each step's token of every row still decoding, by original row through compaction
    (checked every 2 steps, down to 1 row): per row, the told tokens and log-probs are ``generate``'s completion,
    exactly. A listener that wants to stop after 3 steps gets every row cut there: the first 3 tokens of the whole."""
    from arctic_rl.rollout.engines.base import StreamsTokens

    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    sampling = SamplingConfig(n=4, max_tokens=24, seed=7)
    original, dec = _with_eos(engine, frequent_eos), engine.decoder
    try:
        dec.check_every, dec.min_rows = 2, 1
        whole = [c for o in engine.generate(prompt_ids, sampling) for c in o]
        told, cut = StepRecorder(), StepRecorder(stop_after=3)
        streamed = [c for o in engine.generate_streamed(prompt_ids, sampling, told) for c in o]
        stopped = [c for o in engine.generate_streamed(prompt_ids, sampling, cut) for c in o]
    finally:
        engine.eos_id, dec.eos_id = original
        dec.check_every, dec.min_rows = 8, 8
    assert isinstance(engine, StreamsTokens)
    lengths = [len(c.token_ids) for c in whole]
    assert min(lengths) < 3 < max(lengths) and len(set(lengths)) > 3  # rows stop at different steps
    assert [(c.token_ids, c.logprobs, c.token_versions) for c in streamed] == [(c.token_ids, c.logprobs, c.token_versions)
                                                                              for c in whole]
    rows = range(len(whole))
    assert [[t for s in told.steps for t in s.token_ids[r]] for r in rows] == [c.token_ids for c in whole]
    assert [[lp for s in told.steps for lp in s.logprobs[r]] for r in rows] == [c.logprobs for c in whole]
    assert len(told.steps) == max(lengths)  # a step per token, until the last row stops
    assert len(cut.steps) == 3
    for full, short in zip(whole, stopped):
        assert (short.token_ids, short.logprobs) == (full.token_ids[:3], full.logprobs[:3])
        assert short.finish_reason == ("stop" if len(full.token_ids) <= 3 else "length")
