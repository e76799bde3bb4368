"""GPU: the policy's AdamW (``grpo.adamw``) is torch's fused kernel on CUDA, and under DeepSpeed ZeRO-1/2/3 that
fused optimizer is what steps ZeRO's fp32 partitions, with the same result as torch's unfused AdamW.

Reference: the same run with ``fused=False`` (torch's for-each AdamW). Both fp32, so they differ only by the fused
kernel's rounding: losses to rel 1e-6, weights after 4 steps at lr 1e-3 to 1e-6 absolute."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
STEPS = 4


def run(stage: int, fused: bool | None, tmp_path) -> tuple[list[float], dict[str, torch.Tensor], object]:
    import lightning.pytorch as pl
    from transformers import AutoConfig, AutoModelForCausalLM

    from arctic_rl.modules.grpo import adamw
    from arctic_rl.strategies import ArcticStrategy

    losses: list[float] = []

    class Tiny(pl.LightningModule):
        def configure_model(self):
            if getattr(self, "model", None) is None:
                torch.manual_seed(0)
                config = AutoConfig.for_model("qwen3", vocab_size=128, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
                self.model = AutoModelForCausalLM.from_config(config)

        def training_step(self, batch, _):
            loss = self.model(input_ids=batch, labels=batch).loss
            losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return adamw(list(self.model.parameters()), lr=1e-3, weight_decay=0.01, fused=fused)

    data = torch.randint(0, 128, (STEPS * 2, 32), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="32-true", strategy=ArcticStrategy(stage=stage),
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    module = Tiny()
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(list(data), batch_size=2))
    import deepspeed

    params = list(module.model.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        weights = {n: p.detach().float().cpu().clone() for n, p in params}
    inner = trainer.optimizers[0]
    while not hasattr(inner, "defaults") and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return losses, weights, inner


@pytest.fixture
def own_process_group(monkeypatch):
    """Lightning joins this pytest process to a 1-rank process group on a free port (kept for the later tests: DeepSpeed
    caches its groups); the environment is restored after each test, so later tests' subprocesses do not inherit
    the port."""
    from arctic_rl.weight_sync.broadcast import free_port

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1", "RANK": "0",
                        "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    yield


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_steps_its_partitions_with_the_fused_adamw_as_unfused_adamw_does(stage, tmp_path, own_process_group):
    losses, weights, optimizer = run(stage, None, tmp_path / "fused")
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True
    assert all(p.is_cuda and p.dtype == torch.float32 for group in optimizer.param_groups for p in group["params"])
    ref_losses, ref_weights, ref_optimizer = run(stage, False, tmp_path / "unfused")
    assert not ref_optimizer.defaults["fused"]
    assert len(losses) == STEPS and losses == pytest.approx(ref_losses, rel=1e-6)
    assert losses[-1] < losses[0]  # it trains
    for name, w in weights.items():
        torch.testing.assert_close(w, ref_weights[name], rtol=0, atol=1e-6, msg=name)
