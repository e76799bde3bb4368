"""``GRPOModule`` provides every member of ``RolloutPolicy``, the rollout side's view of it: a renamed
attribute or hyperparameter fails here, not in the middle of a run."""

import inspect

from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.modules.options import SamplingOptions
from arctic_rl.rollout.policy import RewardSettings, RolloutPolicy, RolloutSettings, SamplerCorrection, SamplingSettings
from arctic_rl.tasks.toy import tiny_qwen3_config


def members(protocol: type) -> set[str]:
    methods = {name for name, _ in inspect.getmembers(protocol, inspect.isfunction) if not name.startswith("_")}
    return set(protocol.__annotations__) | methods


def test_grpo_module_satisfies_rollout_policy(toy_task):
    module = GRPOModule(model=tiny_qwen3_config(33), tokenizer=str(toy_task / "tokenizer"),
                        sampling=SamplingOptions(max_prompt_length=32, max_response_length=8))
    attached_only = {"trainer"}  # LightningModule.trainer raises until a Trainer is attached
    built_only = {"vocab_size"}  # read from the model, which configure_model builds
    assert members(RolloutPolicy) == {
        "options", "model_dtype", "tokenizer", "group_size", "max_prompt_length", "max_response_length", "mini_batches", "num_iterations",
        "corrections", "device", "trainer", "reward", "is_correct", "compute_advantages", "save_policy",
        "named_parameters_for_sync", "log", "vocab_size"}
    assert [name for name in sorted(members(RolloutPolicy) - attached_only - built_only) if not hasattr(module, name)] == []
    module.configure_model()
    assert module.vocab_size == 33
    assert [name for name in RolloutSettings.__annotations__ if not hasattr(module.options, name)] == []
    assert [name for name in SamplingSettings.__annotations__ if not hasattr(module.options.sampling, name)] == []
    assert [name for name in RewardSettings.__annotations__ if not hasattr(module.options.rollout, name)] == []
    assert [name for name in SamplerCorrection.__annotations__ if not hasattr(module.corrections, name)] == []
