"""A non-finite gradient never reaches the weights under ``fit``: a real 2-step quickstart run (transformers engine)
whose first step's loss is finite but its gradient infinite skips that step (weights and AdamW state as before it,
a warning naming the step), counts it (``skipped_nonfinite_steps``, ``global_step``), and trains the next, under
plain torch and under DeepSpeed ZeRO-2 and ZeRO-3 (``ArcticStrategy``, 1 process over gloo)."""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path

import pytest
import torch

from arctic_rl.cli import build_cli
from arctic_rl.tasks.toy import EchoDigitGRPO
from arctic_rl.weight_sync.broadcast import free_port
from tests.helpers import quickstart_config, run_cli, write_config
from tests.nonfinite import InfiniteGradient

pytestmark = pytest.mark.slow
POISONED = "tests.modules.test_nonfinite_step.InfiniteFirstGradientGRPO"
WEIGHTS_FILE = "weights_around_steps.pt"



class InfiniteFirstGradientGRPO(EchoDigitGRPO):
    """The echo task whose step-0 loss has an infinite gradient; writes the policy's weights before and after each
    step, and AdamW's step counts, to ``default_root_dir/weights_around_steps.pt``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[int, dict[str, dict[str, torch.Tensor]]] = {}

    def policy_loss(self, *args, **kwargs):
        loss, stats = super().policy_loss(*args, **kwargs)
        return (InfiniteGradient.apply(loss) if self.global_step == 0 else loss), stats

    def _weights(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().clone() for name, tensor in self.named_parameters_for_sync()}  # ZeRO-3: gathered

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.seen[self.global_step] = {"before": self._weights()}

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.seen[self.global_step - 1]["after"] = self._weights()

    def on_train_end(self) -> None:
        optimizer = self.trainer.optimizers[0]
        adamw = optimizer if isinstance(optimizer, torch.optim.AdamW) else optimizer.optimizer  # ZeRO wraps the AdamW
        adam_steps = sorted({float(state["step"]) for state in adamw.state.values()})
        if self.trainer.is_global_zero:
            torch.save({"seen": self.seen, "adam_steps": adam_steps, "global_step": self.global_step},
                       Path(self.trainer.default_root_dir) / WEIGHTS_FILE)


def poisoned_config(toy_task, root: Path) -> dict:
    config = quickstart_config(toy_task, root, **{"model.class_path": POISONED, "trainer.max_steps": 2,
                                                  "data.init_args.batch_size": 4, "model.init_args.sampling.group_size": 4,
                                                  "trainer.enable_progress_bar": False})
    config["trainer"]["callbacks"][0]["init_args"]["engine"] = "transformers"
    return config


def logged(root: Path, key: str) -> list[float]:
    (path,) = root.glob("logs/version_*/metrics.csv")
    with open(path) as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


def check_first_step_skipped_and_second_trained(root: Path) -> None:
    record = torch.load(root / WEIGHTS_FILE, weights_only=True)
    assert record["global_step"] == 2  # the skipped step counts: resume and the schedule see the same step numbers
    skipped, trained = record["seen"][0], record["seen"][1]
    assert skipped["before"].keys() == skipped["after"].keys() and skipped["before"]
    for name, before in skipped["before"].items():
        assert torch.equal(skipped["after"][name], before), name  # bit for bit: the bad step never reached them
    assert all(torch.isfinite(t).all() for t in trained["after"].values())
    assert any(not torch.equal(trained["after"][n], t) for n, t in trained["before"].items())  # step 1 trained
    assert record["adam_steps"] == [1.0]  # AdamW stepped once (step 1): step 0 left its state alone
    assert logged(root, "skipped_nonfinite_steps") == [1.0, 0.0]
    grad_norms = logged(root, "grad_norm")
    assert not math.isfinite(grad_norms[0]) and math.isfinite(grad_norms[1]) and grad_norms[1] > 0


def test_plain_torch_fit_skips_a_non_finite_gradients_step_and_keeps_the_weights(toy_task, tmp_path, caplog):
    config = poisoned_config(toy_task, tmp_path / "run")
    cli = build_cli(["--config", str(write_config(config, tmp_path / "c.yaml"))], run=False)
    with caplog.at_level(logging.WARNING, logger="arctic_rl.modules.training_core"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    check_first_step_skipped_and_second_trained(tmp_path / "run")
    warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("step 0 skipped: the gradient norm is nan (not finite)"), warnings


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_fit_skips_a_non_finite_gradients_step_and_keeps_the_weights(toy_task, tmp_path, stage):
    config = poisoned_config(toy_task, tmp_path / "run")
    extra = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else None
    config["trainer"]["strategy"] = {"class_path": "arctic_rl.strategies.ArcticStrategy",
                                     "init_args": {"stage": stage, "config": extra}}
    proc = run_cli(config, tmp_path / "c.yaml", timeout=600, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", NODE_RANK="0", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_first_step_skipped_and_second_trained(tmp_path / "run")
    assert "step 0 skipped: the gradient norm is inf (not finite)" in proc.stderr
