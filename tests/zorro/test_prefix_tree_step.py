"""``model.compute.zorro_dedup``: the option's checks, and one training step's forward/backward
(``TrainingCore.backward_batch``: micro-batch losses with GRPOModule's loss, mask and weights) with
``tree`` equal to ``group`` on a GRPO batch and to the naive path (``zorro: false``) on a batch whose
sequences share multi-turn prefixes (observation holes in the masks), float64 on CPU.

Tolerance: absolute 1e-10 on the loss and every gradient (relative 1e-10 as well); the RMSNorms run
in float64 as in ``test_prefix_tree.py`` (transformers' own computes in float32 whatever the dtype)."""

from types import SimpleNamespace

import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.modules.corrections import CorrectionConfig
from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.modules.losses import LossConfig, LossNormalizer, Regularizers
from arctic_rl.modules.builtin_losses import fit_loss_config
from arctic_rl.modules.options import ComputeOptions
from arctic_rl.modules.training_core import TrainingCore
from arctic_rl.rollout.batch import RolloutBatch

from .models import build_tiny, make_batch, twin
from .test_prefix_tree import batch_of, make_case, rms_norm_in_input_dtype

TOL = 1e-10


class Core(TrainingCore):
    """The training core with GRPOModule's loss hooks, outside Lightning (world size 1, plain backward)."""

    policy_loss, loss_mask, policy_weights = GRPOModule.policy_loss, GRPOModule.loss_mask, GRPOModule.policy_weights

    def __init__(self, model, zorro: bool, dedup: str, micro_batch_tokens: int | None = None):
        self.model, self.tokenizer = model, SimpleNamespace(pad_token_id=0)
        self.options = SimpleNamespace(sampling=SimpleNamespace(temperature=0.8),
                                       compute=SimpleNamespace(zorro=zorro, attention_backend="sdpa", zorro_dedup=dedup,
                                                               sequence_parallel=1),
                                       corrections=SimpleNamespace(router_replay=False))
        self.trainer, self.global_step = SimpleNamespace(world_size=1), 0
        self.micro_batch_size, self.micro_batch_tokens = None, micro_batch_tokens
        self.loss_config, self.corrections, self.regularizers = LossConfig(), CorrectionConfig(), Regularizers()
        self.loss_options = fit_loss_config(self.loss_config, self.regularizers)
        self.loss_inputs_needed = {"entropy"}  # as regularizers.entropy_coef > 0

    def manual_backward(self, loss):
        loss.backward()


def rollout_of(prompts, ids, mask, group_size):
    n = len(prompts)
    g = torch.Generator().manual_seed(5)
    return RolloutBatch(
        prompt_token_ids=prompts, response_ids=ids, response_mask=mask.double(),
        sampler_logprobs=-torch.rand(ids.shape, generator=g, dtype=torch.float64), rewards=torch.zeros(n, dtype=torch.float64),
        advantages=torch.randn(n, generator=g, dtype=torch.float64), group_size=group_size,
        old_logprobs=-torch.rand(ids.shape, generator=g, dtype=torch.float64),
    )


def step(model, rollout, zorro, dedup, micro_batch_tokens=None):
    core = Core(model, zorro, dedup, micro_batch_tokens)
    normalizer = LossNormalizer.of(core.loss_mask(rollout), rollout.response_ids.shape[1])
    loss, _ = core.backward_batch(rollout, normalizer)
    return loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_step(want, got):
    assert abs(want[0] - got[0]) <= TOL * (1 + abs(want[0])), (want[0], got[0])
    assert want[1].keys() == got[1].keys() and len(want[1]) > 0
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, atol=TOL, rtol=TOL, msg=lambda m: f"{name}: {m}")


@pytest.fixture
def float64_norms(monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", rms_norm_in_input_dtype)


@pytest.mark.parametrize("micro_batch_tokens", [None, 24])
def test_tree_step_equals_group_step_on_a_grpo_batch(float64_norms, micro_batch_tokens):
    prompts, ids, mask = make_batch([6, 4, 5], [0, 0, 0, 1, 1, 1, 2, 2, 2], [3, 5, 2, 4, 1, 3, 2, 2, 6])
    rollout = rollout_of(prompts, ids, mask, group_size=3)
    model = build_tiny("qwen3", dtype=torch.float64)
    group = step(twin(model), rollout, True, "group", micro_batch_tokens)
    tree = step(twin(model), rollout, True, "tree", micro_batch_tokens)
    assert_same_step(group, tree)
    assert_same_step(step(twin(model), rollout, False, "group", micro_batch_tokens), tree)


@pytest.mark.parametrize("case", ["depth3", "empty_turns", "prefix_of_another"])
def test_tree_step_equals_naive_step_on_shared_multi_turn_prefixes(float64_norms, case):
    prompts, ids, mask = make_case(case)
    rollout = rollout_of(prompts, ids, mask, group_size=1)
    model = build_tiny("qwen3", dtype=torch.float64)
    assert_same_step(step(twin(model), rollout, False, "group"), step(twin(model), rollout, True, "tree"))


def test_group_step_refuses_mask_holes():
    prompts, ids, mask = batch_of([([1, 2, 3], [([4, 5], True), ([6], False), ([7], True)])] * 2)
    with pytest.raises(ValueError, match="right-padded prefix"):
        step(build_tiny("qwen3", dtype=torch.float64), rollout_of(prompts, ids, mask, 2), True, "group")


def test_zorro_dedup_option_checks():
    assert ComputeOptions().zorro_dedup == "group"
    assert ComputeOptions(zorro_dedup="tree", attention_backend="flex").zorro_dedup == "tree"
    with pytest.raises(ConfigError, match="zorro_dedup must be one of group, tree, got 'trie'"):
        ComputeOptions(zorro_dedup="trie")
    with pytest.raises(ConfigError, match="needs model.compute.zorro true"):
        ComputeOptions(zorro_dedup="tree", zorro=False)
    for backend in ("cudnn", "flash_varlen"):
        with pytest.raises(ConfigError, match="flex or sdpa attention backends"):
            ComputeOptions(zorro_dedup="tree", attention_backend=backend)
