"""``compute.sequence_parallel``: bad values are refused early, each error naming the field (the exactness of the
split itself: ``tests/zorro/test_sequence_parallel.py``; a 2-rank fit: ``tests/strategies``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from arctic_rl.errors import ConfigError
from arctic_rl.modules.training_core import TrainingCore
from arctic_rl.modules.validation import check_sequence_parallel_model
from arctic_rl.options import ComputeOptions, ModuleOptions


@pytest.mark.parametrize("settings, message", [
    (dict(sequence_parallel=0), r"model.compute.sequence_parallel must be >= 1, got 0"),
    (dict(sequence_parallel=2, zorro=False), r"model.compute.sequence_parallel=2 splits ZoRRo's packed rows: it needs model.compute.zorro true"),
])
def test_bad_settings_are_refused_naming_the_field(settings, message):
    with pytest.raises(ConfigError, match=message):
        ComputeOptions(**settings)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "flex", "cudnn", "flash_varlen"])
def test_every_attention_backend_is_accepted(backend):
    assert ComputeOptions(sequence_parallel=2, attention_backend=backend).attention_backend == backend


@dataclass
class FakeTrainer:  # stands in for Lightning's Trainer: only its world size is read before the groups are built
    world_size: int


class Core(TrainingCore):
    def __init__(self, degree: int, world: int):
        self.options, self.trainer = ModuleOptions(compute=ComputeOptions(sequence_parallel=degree)), FakeTrainer(world)


@pytest.mark.parametrize("degree, world", [(2, 3), (4, 6), (2, 1)])
def test_a_degree_that_does_not_divide_the_world_is_refused(degree, world):
    with pytest.raises(ConfigError, match=rf"model.compute.sequence_parallel={degree} must divide the number of training "
                                          rf"ranks \({world}\)"):
        Core(degree, world).sequence_parallel


def test_degree_one_is_off():
    assert Core(1, 8).sequence_parallel is None


def test_models_whose_heads_or_layers_do_not_split_are_refused_before_they_are_built():
    from tests.zorro.models import CONFIGS

    qwen3 = CONFIGS["qwen3"]  # 4 query heads
    check_sequence_parallel_model(qwen3, ComputeOptions(sequence_parallel=4))
    with pytest.raises(ConfigError, match=r"model.compute.sequence_parallel=3 .* 'qwen3' has 4 query heads, not a multiple of 3"):
        check_sequence_parallel_model(qwen3, ComputeOptions(sequence_parallel=3))
    with pytest.raises(ConfigError, match=r"model.compute.sequence_parallel=2: model type 'qwen3_next' has linear-attention"):
        check_sequence_parallel_model(CONFIGS["qwen3_next"], ComputeOptions(sequence_parallel=2))


def test_router_replay_is_refused_beside_sequence_parallelism():
    from arctic_rl.modules.validation import check_settings
    from arctic_rl.options import CorrectionConfig, SamplingOptions
    from tests.zorro.models import CONFIGS

    options = ModuleOptions(compute=ComputeOptions(sequence_parallel=2), corrections=CorrectionConfig(router_replay=True),
                            sampling=SamplingOptions(group_size=2, max_prompt_length=16, max_response_length=16))  # fits 64 positions
    with pytest.raises(ConfigError, match=r"model.compute.sequence_parallel=2 and model.corrections.router_replay"):
        check_settings(CONFIGS["qwen3_moe"], "unused", "float32", options)
