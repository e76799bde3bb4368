"""GPU: the transformers engine with CUDA graphs (bf16, a small Qwen3): samples equal the eager decode's, graphs
captured by one call are replayed by the next (same samples as freshly captured ones), log-probs stay within bf16
error of the model's own forward, and ``sleep()`` gives the memory back."""

import pytest
import torch

from arctic_rl.rollout.engines.base import SamplingConfig

pytestmark = pytest.mark.gpu

CONFIG = dict(model_type="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    from arctic_rl.modules.models import build_causal_lm
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gpu_qwen3")
    build_causal_lm(dict(CONFIG), "bfloat16").save_pretrained(out)
    tokenizer.save_pretrained(out)
    eng = TransformersEngine(str(out), dtype="bfloat16", device="cuda")
    yield eng
    eng.shutdown()


def prompts(count=6):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, 4000, (int(torch.randint(10, 60, (1,), generator=g)),), generator=g).tolist() for _ in range(count)]


def test_cuda_graph_decode_equals_the_eager_decode(engine):
    sampling = SamplingConfig(n=4, max_tokens=80, seed=3, temperature=0.9, top_p=0.95)
    graphed = engine.generate(prompts(), sampling)
    engine.decoder.cuda_graphs = False
    try:
        eager = engine.generate(prompts(), sampling)
    finally:
        engine.decoder.cuda_graphs = True
    assert [c.token_ids for o in graphed for c in o] == [c.token_ids for o in eager for c in o]
    for a, b in zip((c for o in graphed for c in o), (c for o in eager for c in o)):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


def test_graphs_captured_by_one_call_are_replayed_by_the_next(engine):
    """The rollout stream's rounds are many calls of one budget: the second call of a shape captures nothing, and its
    samples equal those of a decoder that captured its graphs afresh."""
    sampling = SamplingConfig(n=4, max_tokens=40, seed=11, temperature=0.9)
    engine.decoder.drop_arena()
    engine.generate(prompts(), sampling)
    captured = len(engine.decoder.arena.graphs)
    other = [p[: len(p) // 2 + 1] for p in prompts()]  # other prompts, lengths within the same bucket or below
    replayed = engine.generate(other, SamplingConfig(n=4, max_tokens=40, seed=12, temperature=0.9))
    assert captured > 0 and len(engine.decoder.arena.graphs) == captured
    engine.decoder.drop_arena()
    fresh = engine.generate(other, SamplingConfig(n=4, max_tokens=40, seed=12, temperature=0.9))
    assert [c.token_ids for o in replayed for c in o] == [c.token_ids for o in fresh for c in o]
    for a, b in zip((c for o in replayed for c in o), (c for o in fresh for c in o)):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


def test_logprobs_are_the_models_own_within_bf16_error(engine):
    ids = prompts()
    outputs = engine.generate(ids, SamplingConfig(n=2, max_tokens=64, seed=5))
    worst = 0.0
    with torch.no_grad():
        for prompt, per_prompt in zip(ids, outputs):
            for c in per_prompt:
                x = torch.tensor([prompt + c.token_ids], device="cuda")
                logits = engine.model(input_ids=x).logits[0, len(prompt) - 1 : -1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, x[0, len(prompt):, None]).squeeze(-1)
                worst = max(worst, (lp.cpu() - torch.tensor(c.logprobs)).abs().max().item())
    assert worst < 0.1  # bf16 logits of one model, two kernel orders (batched decode vs one full forward)


def test_sleep_gives_the_weights_memory_back_and_wake_up_restores_it(engine):
    engine.generate(prompts(2), SamplingConfig(n=2, max_tokens=16, seed=1))
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    engine.sleep()
    asleep = torch.cuda.memory_allocated()
    engine.wake_up()
    assert awake - asleep >= weights  # the weights, the KV cache and the graphs kept between calls leave the GPU
    woken = torch.cuda.memory_allocated()
    assert woken - asleep >= weights and woken <= awake  # the weights come back; the decode buffers with the next call
    before = engine.generate(prompts(2), SamplingConfig(n=2, max_tokens=16, seed=1))
    assert all(len(c.token_ids) == 16 or c.finish_reason == "stop" for o in before for c in o)


def test_streamed_steps_with_cuda_graphs_add_up_to_the_completions_and_skip_padding_rows(engine):
    """``generate_streamed`` under CUDA graphs: 3 rows run padded to 8 (finished padding rows), each step is told for
    the call's 3 rows only, the told tokens and log-probs per row are ``generate``'s, and a listener that wants to stop
    after 5 steps gets the first 5 tokens of each row."""

    class Steps:
        def __init__(self, stop_after=None):
            self.steps, self.stop_after = [], stop_after

        def on_step(self, step):
            self.steps.append(step)

        def wants_stop(self):
            return self.stop_after is not None and len(self.steps) >= self.stop_after

    sampling = SamplingConfig(n=1, max_tokens=40, seed=5, temperature=0.9)
    whole = [c for o in engine.generate(prompts(3), sampling) for c in o]
    told, cut = Steps(), Steps(stop_after=5)
    streamed = [c for o in engine.generate_streamed(prompts(3), sampling, told) for c in o]
    stopped = [c for o in engine.generate_streamed(prompts(3), sampling, cut) for c in o]
    assert [(c.token_ids, c.logprobs) for c in streamed] == [(c.token_ids, c.logprobs) for c in whole]
    assert {len(s.token_ids) for s in told.steps} == {3}
    assert [[t for s in told.steps for t in s.token_ids[r]] for r in range(3)] == [c.token_ids for c in whole]
    assert [[lp for s in told.steps for lp in s.logprobs[r]] for r in range(3)] == [c.logprobs for c in whole]
    assert [c.token_ids for c in stopped] == [c.token_ids[:5] for c in whole] and len(cut.steps) == 5
