"""ZoRRo against each family's *own* forward: every sample run alone and unpadded through
``model(ids)`` with transformers' SDPA attention (eager for soft-capped / sink families, which SDPA
cannot express), on CPU in fp32 and float64. Prompts are longer than the window (``WINDOW = 4``), with several groups,
interleaved samples, empty responses and groups of one.

Two levels:

* hidden states (the decoder's last, normed output at every predicting position) and every
  decoder parameter's gradient of a loss on them: ZoRRo's attention part, exact for all families;
* log-probs, entropies and every parameter's gradient through the head, whose logit transform
  (Granite ``logits_scaling``, Gemma2 ``final_logit_softcapping``) is measured from the model
  (``head_spec.py``).
"""

import pytest
import torch

from arctic_rl.modules.models import response_logprobs
from arctic_rl.zorro import zorro_response_logprobs
from arctic_rl.zorro.logprobs import packed_hidden_states
from arctic_rl.zorro.packing import pack_shared_prompts, response_lengths

from .models import build_tiny, make_batch, twin

FAMILIES = ["qwen3", "qwen3_moe", "llama", "mistral", "qwen2", "gemma2", "gemma3_text", "olmo2", "phi3", "gpt_oss",
            "granite", "phimoe"]
CASES = {  # prompt lengths (all > WINDOW), prompt of each sample, response lengths
    "groups_interleaved_and_empty": ([7, 10], [0, 1, 0, 1, 0], [6, 3, 0, 5, 2]),
    "groups_of_one": ([9, 6, 5], [0, 1, 2, 1], [5, 7, 1, 4]),
}
# values: absolute; gradients: max |difference| relative to the tensor's largest entry (embedding
# gradients sum many tokens and are large). The families' RMSNorms compute in fp32 even on float64
# inputs, so float64 gradients are only ~1e-7 accurate on *both* sides; values stay exact.
TOL = {torch.float32: dict(atol=2e-5, grad=2e-5), torch.float64: dict(atol=1e-9, grad=2e-6)}
EAGER_REFERENCE = {"gemma2", "gpt_oss"}  # soft-cap / sinks: only the family's eager function has them
# Gemma2's eager function takes its softmax in fp32 even for float64 inputs: its float64 reference
# is fp32-accurate, so that pair is compared at fp32 tolerance
FP32_SOFTMAX_REFERENCE = {"gemma2"}
TEMPERATURE = 0.7


def reference_pair(kind: str, dtype: torch.dtype):
    """(reference model with eager attention, an identical model for ZoRRo)."""
    ref = build_tiny(kind, dtype=dtype, attn_implementation="eager" if kind in EAGER_REFERENCE else "sdpa")
    if kind == "phimoe":  # its router samples experts at random in train mode (sparsemixer)
        ref.eval()
    return ref, twin(ref)


def tolerance(kind: str, dtype: torch.dtype) -> dict:
    return TOL[torch.float32 if kind in FP32_SOFTMAX_REFERENCE else dtype]


def own_forward(model, prompts, ids, mask, temperature=TEMPERATURE):
    """Per sample, alone and unpadded: ``log_softmax(model(ids).logits / T)`` at the response
    tokens, the entropy there, and the decoder's last hidden state at the predicting positions."""
    n, r = ids.shape
    lp, ent = torch.zeros(n, r, dtype=model.dtype), torch.zeros(n, r, dtype=model.dtype)
    hidden = []
    for i, length in enumerate(response_lengths(mask)):
        if not length:
            continue
        p = len(prompts[i])
        seq = torch.tensor([prompts[i] + ids[i, :length].tolist()])
        out = model(seq)
        logp = torch.log_softmax(out.logits[0, p - 1 : p + length - 1].to(lp.dtype) / temperature, -1)
        lp[i, :length] = logp.gather(-1, ids[i, :length, None])[:, 0]
        ent[i, :length] = -(logp.exp() * logp).sum(-1)
        hidden.append(model.get_decoder()(seq).last_hidden_state[0, p - 1 : p + length - 1])
    return lp, ent, torch.cat(hidden)


def zorro_hidden(model, prompts, ids, mask, prompts_first=False):
    layout = pack_shared_prompts(prompts, ids, response_lengths(mask), prompts_first=prompts_first)
    return packed_hidden_states(model, layout, "sdpa")[layout.predictor_index]


def weights_like(x, seed):
    return torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(x.dtype)


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, want: dict, tol: dict):
    assert got.keys() == want.keys() and want, (sorted(got), sorted(want))
    errors = {name: ((got[name] - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for name, w in want.items()}
    bad = {name: e for name, e in errors.items() if not e <= tol["grad"]}
    assert not bad, f"gradients off by more than {tol['grad']} of their largest entry: {bad}"


def _hidden_params():
    """float64 for every family: the attention part alone, at float64 accuracy."""
    for kind in FAMILIES:
        yield pytest.param(kind, "groups_interleaved_and_empty", torch.float64, id=f"{kind}-fp64")


@pytest.mark.parametrize("kind,case,dtype", list(_hidden_params()))
def test_hidden_states_and_decoder_grads_match_own_forward(kind, case, dtype):
    prompts, ids, mask = make_batch(*CASES[case])
    ref, zmodel = reference_pair(kind, dtype)
    want_h = own_forward(ref, prompts, ids, mask)[2]
    (weights_like(want_h, 1) * want_h).sum().backward()
    got_h = zorro_hidden(zmodel, prompts, ids, mask)
    (weights_like(got_h, 1) * got_h).sum().backward()
    tol = tolerance(kind, dtype)
    torch.testing.assert_close(got_h, want_h, atol=tol["atol"], rtol=0)
    assert_grads_close(grads(zmodel), grads(ref), tol)


def _logprob_params():
    for kind in FAMILIES:
        for case, dtype in [(c, torch.float32) for c in CASES] + [("groups_interleaved_and_empty", torch.float64)]:
            yield pytest.param(kind, case, dtype, id=f"{kind}-{case}-{str(dtype)[6:]}")


@pytest.mark.parametrize("kind,case,dtype", list(_logprob_params()))
def test_logprobs_entropy_and_grads_match_own_forward(kind, dtype, case):
    prompts, ids, mask = make_batch(*CASES[case])
    ref, zmodel = reference_pair(kind, dtype)
    want_lp, want_ent, _ = own_forward(ref, prompts, ids, mask)
    ((weights_like(want_lp, 2) * want_lp).sum() + (weights_like(want_ent, 3) * want_ent).sum()).backward()
    lp, ent = zorro_response_logprobs(zmodel, prompts, ids, mask, TEMPERATURE, True, pad_token_id=0, attention_backend="sdpa")
    ((weights_like(lp, 2) * lp).sum() + (weights_like(ent, 3) * ent).sum()).backward()
    tol = tolerance(kind, dtype)
    torch.testing.assert_close(lp.to(dtype), want_lp, atol=tol["atol"], rtol=0)
    torch.testing.assert_close(ent.to(dtype), want_ent, atol=tol["atol"], rtol=0)
    assert_grads_close(grads(zmodel), grads(ref), tol)


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "mistral"])
def test_prompts_first_row_gives_the_same_hidden_states(kind):
    """The cascade layout (all prompts first) under the same windows, caps and sinks."""
    prompts, ids, mask = make_batch(*CASES["groups_interleaved_and_empty"])
    model = reference_pair(kind, torch.float32)[1]
    with torch.no_grad():
        a, b = (zorro_hidden(model, prompts, ids, mask, prompts_first=f) for f in (False, True))
    torch.testing.assert_close(b, a, atol=2e-6, rtol=0)


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_ordinary_forwards_after_the_switch_keep_caps_and_sinks(kind):
    """A naive padded forward through the switched model (``"zorro"`` without a packed mask) still
    soft-caps / adds sinks (transformers' SDPA function would silently drop both)."""
    prompts, ids, mask = make_batch(*CASES["groups_of_one"])
    ref = build_tiny(kind, attn_implementation="eager")
    zmodel = twin(ref)
    zorro_hidden(zmodel, prompts, ids, mask)  # switches to "zorro"
    assert zmodel.config._attn_implementation == "zorro"
    with torch.no_grad():
        got = response_logprobs(zmodel, prompts, ids, mask, 1.0, False, 0)[0]
        want = response_logprobs(ref, prompts, ids, mask, 1.0, False, 0)[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
