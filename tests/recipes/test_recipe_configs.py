"""Every recipe config names the command that runs it first, and its task class and data exist in
the shapes the recipe's README promises."""

import importlib
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO

CONFIGS = sorted((REPO / "recipes").glob("*/*.yaml")) + [REPO / "configs/gpu_single.yaml"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_config_starts_with_its_command_and_names_a_real_task(path: Path):
    head = path.read_text().splitlines()[:3]
    command = f"arctic-rl fit --config {path.resolve().relative_to(REPO)}"  # gpu_single.yaml links to the recipe's
    assert head[0].startswith("#") and any(command in line for line in head), head
    config = yaml.safe_load(path.read_text())
    module, _, name = config["model"]["class_path"].rpartition(".")
    assert issubclass(getattr(importlib.import_module(module), name), importlib.import_module("arctic_rl").GRPOModule)
    assert config["data"]["init_args"]["train_path"].startswith("data/")  # beside the config: recipes/<name>/data


def test_gpu_single_is_the_gsm8k_recipe():
    assert (REPO / "configs/gpu_single.yaml").resolve() == REPO / "recipes/gsm8k/qwen3_1.7b.yaml"
