"""Tiny CLI runs shared by the failure and resume tests of this folder: an uninterrupted run to
compare against, step by step, and the same run stopped mid-epoch by ``max_steps``."""

from __future__ import annotations

import pytest

from arctic_rl.cli import main
from tests.helpers import quickstart_config, write_config

STEPS = 6  # 64 prompts / batch 16 = 4 batches per epoch: the runs cross into epoch 1


def run_config(toy_task, root, *callbacks: dict) -> dict:
    """The quickstart at G=2, 16 prompts a step, no periodic checkpoints (only ``last.ckpt``), recording
    every step's prompts into ``root/steps.jsonl``."""
    config = quickstart_config(toy_task, root, **{"model.init_args.sampling.group_size": 2, "trainer.max_steps": STEPS,
                                                  "trainer.enable_progress_bar": False})
    config["trainer"]["callbacks"][1]["init_args"]["every_n_train_steps"] = 100
    record = {"class_path": "tests.resume.recorder.RecordSteps", "init_args": {"path": str(root / "steps.jsonl")}}
    config["trainer"]["callbacks"] += [record, *callbacks]
    return config


@pytest.fixture(scope="session")
def reference_run(toy_task, tmp_path_factory):
    """``steps.jsonl`` of an uninterrupted run of ``STEPS`` steps."""
    root = tmp_path_factory.mktemp("reference")
    fit(run_config(toy_task, root), root / "c.yaml")
    return root / "steps.jsonl"


def fit(config: dict, path, *args: str) -> None:
    """``arctic-rl fit --config <config written to path> *args``, in this process (the real CLI)."""
    main(["fit", "--config", str(write_config(config, path)), *args])


@pytest.fixture(scope="session")
def short_run(toy_task, tmp_path_factory):
    """The same run stopped by ``max_steps=3``, mid-epoch 0 (4 batches an epoch): its ``last.ckpt`` is
    the end-of-run save (3 is not a multiple of ``every_n_train_steps``)."""
    root = tmp_path_factory.mktemp("short")
    fit(run_config(toy_task, root), root / "c.yaml", "--trainer.max_steps", "3")
    return root
