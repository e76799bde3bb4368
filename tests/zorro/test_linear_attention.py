"""ZoRRo on hybrid linear-attention models: Qwen3-Next (``qwen3_next``, MoE) and Qwen3.5
(``qwen3_5_text``) interleave gated DeltaNet layers with full attention. Against the model's own forward,
each sample alone and unpadded (``model(ids).logits``), on CPU in fp32 and float64: log-probs, entropies
and every parameter's gradient; several groups, prompts of different lengths (also shorter than the
convolution's context and longer than the delta rule's 64-token chunks), empty responses, groups of
one, gradient checkpointing.

Tolerances: transformers' gated delta rule computes in fp32 whatever the model's dtype, so float64 runs
are compared at fp32-level accuracy. Its gradients of the decay parameters (``A_log``, ``dt_bias`` and
the ``a`` projection) sum many terms of mixed sign: the per-sequence forward disagrees with *itself* by
up to 2e-4 of the largest entry when only its chunk size changes (64 -> 2, measured on these models'
short cases), and ZoRRo's split of a 136-token sequence at the prompt's end differs from it by 2.4e-3 (the
across-chunks case), so those are compared at 5e-3; all other parameters, and all values, as tightly as
the dense families (2e-5).
"""

import pytest
import torch

from arctic_rl.modules.models import response_logprobs
from arctic_rl.zorro import ZorroUnsupportedModel, zorro_response_logprobs
from arctic_rl.zorro.linear_attention import LinearSegments
from arctic_rl.zorro.packing import pack_shared_prompts, response_lengths

from .models import build_tiny, make_batch, twin
from .test_families import TEMPERATURE, grads, own_forward, weights_like

KINDS = ["qwen3_next", "qwen3_5_text"]
CASES = {  # prompt lengths, prompt of each sample, response lengths
    "groups_interleaved_and_empty": ([7, 10], [0, 1, 0, 1, 0], [6, 3, 0, 5, 2]),
    "groups_of_one_short_prompts": ([2, 6, 1], [0, 1, 2, 1], [5, 7, 1, 4]),  # prompts of 1-2 tokens < conv context 3
    "across_chunks": ([70, 3], [0, 0, 1], [66, 5, 9]),  # > 64 tokens: the delta rule's chunks split prompt and response
}
VALUE_ATOL = {torch.float32: 2e-5, torch.float64: 2e-6}
GRAD_TOL, DECAY_GRAD_TOL = 2e-5, 5e-3
DECAY_PARAMS = ("A_log", "dt_bias", "in_proj_a.", "in_proj_ba.")


def run_both(kind, case, dtype, checkpointing=False):
    """(ZoRRo log-probs, entropies, grads), (the same from the model's own per-sequence forward)."""
    prompts, ids, mask = make_batch(*CASES[case])
    ref = build_tiny(kind, dtype=dtype)
    zmodel = twin(ref)
    if checkpointing:
        zmodel.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    want_lp, want_ent, _ = own_forward(ref, prompts, ids, mask)
    ((weights_like(want_lp, 2) * want_lp).sum() + (weights_like(want_ent, 3) * want_ent).sum()).backward()
    lp, ent = zorro_response_logprobs(zmodel, prompts, ids, mask, TEMPERATURE, True, pad_token_id=0, attention_backend="sdpa")
    ((weights_like(lp, 2) * lp).sum() + (weights_like(ent, 3) * ent).sum()).backward()
    return (lp.to(dtype), ent.to(dtype), grads(zmodel)), (want_lp, want_ent, grads(ref))


def assert_match(got, want, dtype):
    (lp, ent, g), (want_lp, want_ent, want_g) = got, want
    torch.testing.assert_close(lp, want_lp, atol=VALUE_ATOL[dtype], rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=VALUE_ATOL[dtype], rtol=0)
    assert g.keys() == want_g.keys() and any("linear_attn" in name for name in want_g), sorted(want_g)
    errors = {name: ((g[name] - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for name, w in want_g.items()}
    bad = {name: e for name, e in errors.items() if not e <= (DECAY_GRAD_TOL if any(p in name for p in DECAY_PARAMS) else GRAD_TOL)}
    assert not bad, f"gradients off (relative to the tensor's largest entry): {bad}"


def _params():
    for kind, case, dtype in [("qwen3_next", "groups_interleaved_and_empty", torch.float32),
                              ("qwen3_next", "groups_of_one_short_prompts", torch.float32),
                              ("qwen3_next", "groups_interleaved_and_empty", torch.float64),
                              ("qwen3_next", "across_chunks", torch.float32),
                              ("qwen3_5_text", "groups_interleaved_and_empty", torch.float64)]:
        yield pytest.param(kind, case, dtype, id=f"{kind}-{case}-{str(dtype)[6:]}")


@pytest.mark.parametrize("kind,case,dtype", list(_params()))
def test_logprobs_entropy_and_grads_match_own_forward(kind, case, dtype):
    assert_match(*run_both(kind, case, dtype), dtype)


def test_gradient_checkpointing_replays_the_segments():
    """Checkpointed layers are re-run in backward, outside the forward: the segments ride along as a
    keyword argument, so the replay splits the row the same way (Qwen3.5, fp32, short prompts)."""
    assert_match(*run_both("qwen3_5_text", "groups_of_one_short_prompts", torch.float32, checkpointing=True), torch.float32)


def test_ordinary_forwards_after_the_switch_are_unchanged():
    """A naive padded forward through a switched hybrid (wrappers installed) is the model's own."""
    prompts, ids, mask = make_batch(*CASES["groups_interleaved_and_empty"])
    ref = build_tiny("qwen3_next")
    zmodel = twin(ref)
    with torch.no_grad():
        zorro_response_logprobs(zmodel, prompts, ids, mask, 1.0, False, 0)
        got = response_logprobs(zmodel, prompts, ids, mask, 1.0, False, 0)[0]
        want = response_logprobs(ref, prompts, ids, mask, 1.0, False, 0)[0]
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


def test_segments_of_a_packed_row():
    """Hand-checked: row ``p0 p1 | a0 a1 a2 | b0 || q0 | c0 c1``, conv width 3 (context 2)."""
    prompts, ids, mask = [[5, 6], [5, 6], [7]], torch.tensor([[1, 2, 3], [4, 0, 0], [8, 9, 0]]), torch.tensor(
        [[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    layout = pack_shared_prompts(prompts, ids, response_lengths(mask))
    segments = LinearSegments.of(layout)
    assert (segments.starts, segments.lengths, segments.parents) == ([0, 2, 5, 6, 7], [2, 3, 1, 1, 2], [-1, 0, 0, -1, 3])
    source, own = segments._conv_index(3)
    assert source.tolist() == [-1, -1, 0, 1, 0, 1, 2, 3, 4, 0, 1, 5, -1, -1, 6, -1, 6, 7, 8]
    assert own.tolist() == [2, 3, 6, 7, 8, 11, 14, 17, 18]
    assert segments._padded(segments.fresh_runs, left=True).tolist() == [[0, 1], [-1, 6]]
    assert segments._padded(segments.continued_runs, left=False).tolist() == [[2, 3, 4], [5, -1, -1], [7, 8, -1]]


def test_linear_layers_that_are_not_gated_deltanet_are_refused():
    """A ``linear_attention`` entry on a family whose layers have no gated DeltaNet (Qwen3 builds
    softmax attention for every layer) is refused by name, never run as full attention."""
    model = build_tiny("qwen3")
    model.config.layer_types = ["linear_attention", "full_attention"]
    prompts, ids, mask = make_batch([3], [0], [2])
    with pytest.raises(ZorroUnsupportedModel, match=r"model type 'qwen3': linear-attention layers \[0\] are not gated DeltaNet"):
        zorro_response_logprobs(model, prompts, ids, mask, 1.0, False, 0)


def test_a_layer_that_skips_the_segments_is_an_error():
    segments = LinearSegments([0], [3], [-1], 3)
    segments.calls["conv"] = 2
    with pytest.raises(ZorroUnsupportedModel, match="of 2 linear-attention layers, 2 routed their convolution and 0 their delta rule"):
        segments.check_calls(2, "qwen3_next")
