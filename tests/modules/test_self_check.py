"""The start-up self-check (``arctic_rl.modules.self_check``): a normal model passes with tiny gaps; a
model whose forward does what arctic-rl's log-prob paths do not reproduce stops with an error
naming the model type, the gap and the way out; the probe is cut from the first batch as documented.
On CUDA (marked gpu): bf16 on FlexAttention and a cascade backend."""

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from arctic_rl.modules.self_check import SelfCheckFailed, check_first_batch, fast_paths, probe_of, run_self_check
from arctic_rl.rollout.batch import RolloutBatch
from tests.zorro.models import build_tiny, make_batch


def rollout_of(prompts, ids, mask, group_size) -> RolloutBatch:
    n = len(prompts)
    return RolloutBatch(prompt_token_ids=prompts, response_ids=ids, response_mask=mask,
                        sampler_logprobs=torch.zeros(ids.shape), rewards=torch.zeros(n), advantages=torch.zeros(n),
                        group_size=group_size)


def first_batch(device="cpu"):
    """3 groups of G = 3 (the probe takes two samples of the first two), one response empty."""
    prompts, ids, mask = make_batch([70, 9, 4], [0, 0, 0, 1, 1, 1, 2, 2, 2], [40, 3, 0, 5, 2, 6, 1, 1, 1], device=device)
    return rollout_of(prompts, ids, mask, group_size=3).to(device)  # training_step moves the whole batch too


class HiddenScaledLlama(LlamaForCausalLM):
    """Scales the final hidden state before its head inside ``forward`` by 0.5, a factor no config
    value gives (MiniCPM3 does this with its ``logits_scaling``, which arctic-rl follows)."""

    def forward(self, input_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(hidden * 0.5))


class LateScaledLlama(LlamaForCausalLM):
    """Halves its logits from the third position on: the two-token head measurement cannot see it,
    only a comparison on real sequences can."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = torch.cat([out.logits[:, :2], out.logits[:, 2:] * 0.5], dim=1)
        return out


class TripledLogitsLlama(LlamaForCausalLM):
    """Multiplies its logits by 3 in ``forward``: no config value says so."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out


def subclassed(cls, dtype=torch.float32):
    base = build_tiny("llama", dtype=dtype)
    model = cls(base.config).to(dtype)
    model.load_state_dict(base.state_dict())
    return model.train()


def test_probe_is_two_groups_of_two_truncated():
    probe = probe_of(first_batch(), prompt_tokens=64, response_tokens=32)
    batch = first_batch()
    assert probe.num_sequences == 4
    assert probe.prompt_token_ids == [batch.prompt_token_ids[i][:64] for i in (0, 1, 3, 4)]
    assert probe.response_ids.shape == (4, 32)
    assert torch.equal(probe.response_mask, batch.response_mask[[0, 1, 3, 4], :32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "llama"])
def test_a_normal_model_passes_with_tiny_gaps(kind, dtype):
    model = build_tiny(kind, dtype=dtype)
    if dtype == torch.float64:
        model.config._experts_implementation = "eager"  # no float64 grouped_mm
    report = check_first_batch(model, first_batch(), zorro=True, attention_backend="sdpa", temperature=0.7, pad_token_id=0)
    assert set(report.max_gap) == {"naive", "zorro_sdpa"}
    limit = 1e-5 if dtype == torch.float32 else 1e-9
    assert all(gap < limit for gap in report.max_gap.values()), report.max_gap
    assert report.sequences == 4 and report.tokens == 40 + 3 + 5 + 2 - 8  # responses cut to 32 tokens
    assert report.seconds > 0 and model.training  # train mode restored
    metrics = report.as_metrics()
    assert set(metrics) == {"self_check/seconds", "self_check/max_gap/naive", "self_check/max_gap/zorro_sdpa"}


def test_a_forward_the_head_measurement_cannot_see_stops_with_a_clear_error():
    model = subclassed(LateScaledLlama)
    with pytest.raises(SelfCheckFailed) as err:
        check_first_batch(model, first_batch(), zorro=True, attention_backend="sdpa", temperature=1.0, pad_token_id=0)
    message = str(err.value)
    assert "model type 'llama' (LateScaledLlama, float32)" in message
    assert "naive: largest" in message and "zorro_sdpa: largest" in message  # the gap of each path, in nats
    assert "the naive path disagrees too" in message and "model.compute.self_check: false" in message


def test_a_forward_that_scales_the_hidden_state_by_an_unknown_factor_stops_with_a_clear_error():
    model = subclassed(HiddenScaledLlama)
    with pytest.raises(SelfCheckFailed, match=r"model type 'llama' \(HiddenScaledLlama\) on the naive path: .*changes the "
                                              r"decoder's last hidden state before the head.*Way out: none in arctic-rl"):
        check_first_batch(model, first_batch(), zorro=True, attention_backend="sdpa", temperature=1.0, pad_token_id=0)


def test_a_forward_that_scales_its_logits_stops_with_a_clear_error():
    model = subclassed(TripledLogitsLlama)
    with pytest.raises(SelfCheckFailed, match=r"model type 'llama' \(TripledLogitsLlama\) on the naive path: .*does not "
                                              r"reproduce.*Way out: none in arctic-rl"):
        run_self_check(model, probe_of(first_batch()), fast_paths(False, "sdpa"), 1.0, 0)


def test_a_zorro_only_gap_points_to_zorro_false():
    """A ZoRRo path that is off (here: a stand-in that shifts its log-probs, named as such) while the
    naive path agrees: the way out is ``zorro: false``."""
    model = build_tiny("qwen3")
    paths = fast_paths(False, "sdpa")
    naive = paths["naive"]
    paths["zorro_sdpa"] = lambda *args: tuple(x - 0.01 * (x != 0) for x in naive(*args))  # stand-in for a wrong mask
    with pytest.raises(SelfCheckFailed, match=r"zorro_sdpa: largest 0\.01.*Way out: the naive per-sequence path agrees.*"
                                              r"set model\.compute\.zorro: false"):
        run_self_check(model, probe_of(first_batch()), paths, 1.0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "cudnn"])
@pytest.mark.parametrize("kind", ["qwen3", "granite", "gemma2"])
def test_bf16_self_check_passes_on_cuda(kind, backend):
    """bf16 on CUDA: the fused head (with Granite's scale, Gemma2's cap) and ZoRRo's GPU backends
    agree with the model's own forward within the bf16 tolerance."""
    from tests.zorro.test_head_families import build_family

    model = build_family(kind, torch.bfloat16, head_dim=16).cuda()  # FlexAttention's kernels need head_dim >= 16
    report = check_first_batch(model, first_batch("cuda"), zorro=True, attention_backend=backend, temperature=1.0,
                               pad_token_id=0)
    assert set(report.max_gap) == {"naive", f"zorro_{backend}"} and report.dtype == torch.bfloat16
