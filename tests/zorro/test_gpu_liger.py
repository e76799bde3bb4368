"""GPU: log-probs, entropies and every gradient with Liger's kernels (``model.compute.liger``) agree with the model
without them, bf16, on the naive path and ZoRRo on every attention backend, gradient checkpointing on; and a
GRPO run under ArcticStrategy ZeRO-3 (1 GPU) trains alike with and without them.

As in ``test_gpu.py``, bf16 cannot match bit for bit: both bf16 runs are compared with an fp32 reference
(the naive path, no Liger, same weights), and the Liger run's relative error must stay within 2x the plain
bf16 run's own error plus a small floor (3x and a larger floor for the MoE, whose bf16 routing can flip).
In fp32 the kernels must match the reference closely. Each test counts calls into the kernels, so a silent
fall-back to the modules' own code fails."""

import collections
import json
import os
import subprocess
import sys

import pytest
import torch

from arctic_rl.liger import LigerOps, apply_liger, has_liger, liger_installed, liger_ops, plan_liger
from arctic_rl.modules.models import response_logprobs
from arctic_rl.zorro import zorro_response_logprobs

from .models import CONFIGS, build_tiny, make_batch, twin
from .test_gpu import GPU_CASES, GPU_SIZES, rel_errors, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not liger_installed(), reason="liger-kernel is not installed")]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATHS = {"naive": (response_logprobs, {})} | {
    f"zorro_{b}": (zorro_response_logprobs, {"attention_backend": b}) for b in ("sdpa", "flex", "cudnn", "flash_varlen")
}


@pytest.fixture(autouse=True)
def gpu_sized_configs(monkeypatch):
    for kind in CONFIGS:
        monkeypatch.setitem(CONFIGS, kind, {**CONFIGS[kind], **GPU_SIZES})


def counted_liger_ops() -> tuple[LigerOps, collections.Counter]:
    """liger-kernel's ops, counting the calls into each."""
    ops, calls = liger_ops(), collections.Counter()

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    return LigerOps(rms_norm=counted("rms_norm", ops.rms_norm), swiglu=counted("swiglu", ops.swiglu),
                    rope=counted("rope", ops.rope), runs_on=ops.runs_on), calls


def with_liger(model):
    ops, calls = counted_liger_ops()
    plan = apply_liger(model, ops)
    return model, plan, calls


def checkpointed(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen3_moe"])
def test_bf16_with_liger_agrees_with_without(kind, path):
    fn, kw = PATHS[path]
    batch = make_batch(*GPU_CASES["shared_varied"], device="cuda")
    ref_model = build_tiny(kind, device="cuda")
    ref = run(response_logprobs, ref_model, batch)
    plain = rel_errors(run(fn, checkpointed(twin(ref_model).to(torch.bfloat16)), batch, **kw), ref)
    model, plan, calls = with_liger(checkpointed(twin(ref_model).to(torch.bfloat16)))
    liger = rel_errors(run(fn, model, batch, **kw), ref)
    used = {"rms_norm": plan.rms_norm, "swiglu": plan.swiglu, "rope": plan.rope}
    assert plan.rms_norm and plan.rope and all(calls[k] > 0 for k, names in used.items() if names), (plan, calls)
    factor, floor = (3, 5e-3) if kind == "qwen3_moe" else (2, 2e-3)
    names = ["logprobs", "entropy"] + [n for n, _ in ref_model.named_parameters()]
    bad = [(n, lg, e) for n, lg, e in zip(names, liger, plain) if lg > factor * e + floor]
    assert not bad, f"{path}: bf16 error with Liger above {factor}x the error without: {bad}"


@pytest.mark.parametrize("path", ["naive", "zorro_flex"])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_fp32_with_liger_matches_reference(kind, path):
    fn, kw = PATHS[path]
    batch = make_batch(*GPU_CASES["shared_varied"], device="cuda")
    ref_model = build_tiny(kind, device="cuda")
    ref = run(response_logprobs, ref_model, batch)
    model, _, calls = with_liger(checkpointed(twin(ref_model)))
    errors = rel_errors(run(fn, model, batch, **kw), ref)
    assert min(calls.values()) > 0 and max(errors) < 1e-3, (calls, errors)


def test_a_model_without_liger_is_untouched_by_anothers():
    """The RoPE switch is per model: an unpatched model's forward is bit-identical before and after another
    model of its family is given Liger, and never reaches the kernels."""
    batch = make_batch(*GPU_CASES["shared_varied"], device="cuda")
    plain = build_tiny("qwen3", device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        before = response_logprobs(plain, *batch, 1.0, True, 0)
        _, _, calls = with_liger(twin(plain))
        after = response_logprobs(plain, *batch, 1.0, True, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and sum(calls.values()) == 0
    assert not any(has_liger(m) for m in plain.modules())
    assert plan_liger(plain).rope  # it would qualify: it is left alone because nobody applied Liger to it


def _zero3_run(tmp_path, liger: str) -> dict:
    out = tmp_path / f"zero3-liger-{liger}.json"
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "grpo_zero3_gpu.py"), "--model", "tiny", "--prompts", "2",
           "--group", "4", "--prompt-len", "96", "--response-len", "48", "--warmup", "0", "--steps", "3",
           "--sides", "zorro", "--liger", liger, "--side-timeout", "240", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    subprocess.run(cmd, check=True, timeout=300, env=env)
    side = json.loads(out.read_text())["sides"]["zorro"]
    assert "error" not in side, f"liger {liger}: {side}"  # the run's own output (above) says why
    return side


@pytest.mark.skipif(not __import__("importlib").util.find_spec("deepspeed"), reason="deepspeed is not installed")
def test_zero3_grpo_steps_agree_with_and_without_liger(tmp_path):
    """A real Trainer with ArcticStrategy(stage=3), bf16-mixed, GRPOModule (ZoRRo flex, gradient checkpointing)
    on scripted rollouts: with ``liger: true`` the policy's modules are swapped while partitioned, and the
    losses and gradient norms of 3 steps match ``liger: false`` to bf16 tolerance."""
    on, off = _zero3_run(tmp_path, "true"), _zero3_run(tmp_path, "false")
    assert on["liger_modules"] > 0 and off["liger_modules"] == 0, (on, off)
    assert len(on["grad_norms"]) == len(off["grad_norms"]) == 3
    for a, b in zip(on["grad_norms"] + on["losses"], off["grad_norms"] + off["losses"]):
        assert abs(a - b) <= 0.03 * abs(b) + 1e-3, (on, off)
