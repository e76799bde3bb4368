"""A LoRA checkpoint resumed into a config whose adapters differ (no LoRA, another rank or targets), or a full one
into a LoRA config: one line naming ``model.lora`` and the fix, exit status 2, before any model starts (the
checkpoint holds the adapters only, so their shape cannot change on resume)."""

from __future__ import annotations

import re

import pytest

from arctic_rl.resume_policy import lora_change
from tests.helpers import run_cli, run_cli_many, write_config
from tests.modules.test_lora_fit import lora_config

START_NEW = r"or start a new run \(without --ckpt_path\) from its exported weights \(model.init_args.model\)$"


@pytest.fixture(scope="module")
def lora_checkpoint(toy_task, tmp_path_factory):
    """``last.ckpt`` of one real ``arctic-rl fit`` step with ``model.lora: {rank: 4, alpha: 8.0}``."""
    root = tmp_path_factory.mktemp("lora_run")
    proc = run_cli(lora_config(toy_task, root, "transformers", steps=1), root / "c.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "checkpoints" / "last.ckpt"


@pytest.mark.slow
def test_a_lora_checkpoint_resumed_with_other_adapters_is_one_line(lora_checkpoint, toy_task, tmp_path):
    cases = {
        "no_lora": (None, r"it holds LoRA adapters only \(model.lora.rank 4\), and this run's config has no LoRA"
                          r" \(model.lora.rank 0\); set model.lora to the checkpoint's \{'rank': 4, 'alpha': 8.0,"
                          r" 'target_modules': None\} to resume, "),
        "rank_8": ({"rank": 8, "alpha": 8.0}, r"its LoRA adapters have model.lora.rank 4, this run's config 8; set"
                                              r" model.lora.rank back to 4 to resume, "),
    }
    commands = {}
    for name, (lora, _) in cases.items():
        config = lora_config(toy_task, tmp_path / name, "transformers", steps=2)
        if lora is None:
            del config["model"]["init_args"]["lora"]
        else:
            config["model"]["init_args"]["lora"] = lora
        commands[name] = ["fit", "--config", str(write_config(config, tmp_path / f"{name}.yaml")), "--ckpt_path", str(lora_checkpoint)]
    done = run_cli_many(commands, tmp_path)
    for name, (_, message) in cases.items():
        proc = done[name]
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "(applied)" not in proc.stderr, proc.stderr[-3000:]
        last = proc.stderr.splitlines()[-1]
        assert re.fullmatch(rf"error: cannot resume from {re.escape(str(lora_checkpoint))}: {message}{START_NEW}", last), last
        assert not (tmp_path / name / "checkpoints").exists()


def test_lora_change_names_each_change_of_the_adapters():
    lora = {"lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj"]}}
    assert lora_change(lora, {"lora": {"rank": 4, "alpha": 16.0, "target_modules": ["q_proj"]}}) is None  # alpha: a scale
    assert lora_change({"sampling": {"group_size": 8}}, {"sampling": {"group_size": 8}}) is None  # a checkpoint before LoRA
    assert lora_change(lora, {"lora": {"rank": 4, "target_modules": ["v_proj"]}}).startswith(
        "its LoRA adapters are on model.lora.target_modules ['q_proj'], this run's config ['v_proj']; set them back")
    assert lora_change({"lora": {"rank": 0}}, lora).startswith(
        "it holds full weights (no LoRA), and this run's config adds LoRA (model.lora.rank 4); remove model.lora to resume")
    assert lora_change({}, lora).startswith("it holds full weights (no LoRA)")


def test_a_module_without_lora_refuses_a_checkpoint_of_adapters_in_one_line():
    """The Python route (``trainer.fit(ckpt_path=...)``), which no resume policy checks: the module's own hook."""
    import torch

    from arctic_rl.errors import ConfigError
    from tests.modules.test_options import SHORT, module

    adapters = {"model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 64)}
    with pytest.raises(ConfigError, match=r"^the checkpoint holds LoRA adapters only, and this model has no LoRA \(model.lora.rank 0\)"):
        module(sampling=SHORT).on_load_checkpoint({"state_dict": adapters})
    module(sampling=SHORT).on_load_checkpoint({"state_dict": {"model.model.norm.weight": torch.ones(64)}})  # full weights: fine
