"""Fast, single-process checks of ArcticStrategy's config, atomic checkpoint files and bucketing."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from arctic_rl.strategies import ArcticStrategy
from arctic_rl.strategies import checkpoint as atomic
from arctic_rl.strategies.arctic import build_config
from arctic_rl.strategies.zero import buckets, gather_in_buckets


def test_config_defaults_and_raw_overrides(tmp_path):
    config = build_config(2, False, False, None)
    assert config["zero_optimization"] == {"stage": 2}
    assert config["managed_gradient_accumulation"] is False  # a variable number of backward passes per step
    assert config["zero_allow_untested_optimizer"] is True
    raw = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "bf16": {"enabled": True}}
    merged = build_config(1, True, False, raw)
    assert merged["zero_optimization"]["stage"] == 3  # the raw config wins, nested keys merge
    assert merged["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert merged["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert merged["bf16"] == {"enabled": True}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    assert build_config(1, True, False, str(path)) == merged


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4, False, False, None), "stage must be 1, 2 or 3"),
        ((2, False, True, None), "offload_parameters needs stage 3"),
        ((2, False, False, "/nonexistent/ds.json"), "not found"),
        ((2, False, False, {"zero_optimization": {"stage": 0}}), "zero_optimization.stage"),
    ],
)
def test_config_errors_name_the_field(args, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        build_config(*args)


def test_strategy_knobs_and_gradient_clipping_handover():
    strategy = ArcticStrategy(stage=3)
    assert strategy.zero_stage_3
    with strategy.model_builder(max_grad_norm=0.5) as build:
        assert build.__name__ == "build_partitioned_causal_lm"
    assert strategy.config["gradient_clipping"] == 0.5
    with ArcticStrategy(stage=2).model_builder(max_grad_norm=None) as build:
        assert build.__name__ == "build_causal_lm"
    conflicting = ArcticStrategy(config={"gradient_clipping": 2.0})
    with pytest.raises(ValueError, match="gradient_clipping=2.0 disagrees with model.optim.max_grad_norm=1.0"):
        with conflicting.model_builder(max_grad_norm=1.0):
            pass


def _staged(final, files: dict[str, str]):
    staging = atomic.new_staging_dir(final)
    for name, text in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_text(text)
    return staging


def test_publish_swaps_checkpoints_atomically_and_cleans_up(tmp_path):
    final = tmp_path / "last.ckpt"
    first = _staged(final, {"checkpoint/a.pt": "1", "latest": "checkpoint"})
    atomic.publish(first, final)
    assert final.is_symlink() and (final / "checkpoint" / "a.pt").read_text() == "1"
    crashed = _staged(final, {"checkpoint/a.pt": "half"})  # a save that died before publishing
    assert (final / "checkpoint" / "a.pt").read_text() == "1"  # last still names the complete one
    second = _staged(final, {"checkpoint/a.pt": "2", "latest": "checkpoint"})
    atomic.publish(second, final)
    assert (final / "checkpoint" / "a.pt").read_text() == "2"
    assert not first.exists() and not crashed.exists()  # the replaced and the orphaned staging dirs
    assert sorted(os.listdir(tmp_path)) == sorted(["last.ckpt", second.name])
    atomic.remove(final)
    assert os.listdir(tmp_path) == []


def test_publish_replaces_a_plain_checkpoint_directory(tmp_path):
    final = tmp_path / "epoch=0-step=2.ckpt"  # as Lightning's DeepSpeedStrategy writes it
    (final / "checkpoint").mkdir(parents=True)
    staging = _staged(final, {"latest": "checkpoint"})
    atomic.publish(staging, final)
    assert final.is_symlink() and (final / "latest").read_text() == "checkpoint"
    assert sorted(os.listdir(tmp_path)) == sorted([final.name, staging.name])


def test_staging_names_are_invisible_to_lightnings_last_checkpoint_search(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    staging = atomic.new_staging_dir(tmp_path / "last.ckpt")
    pattern = rf"^{ModelCheckpoint.CHECKPOINT_NAME_LAST}(-(\d+))?"
    assert not (staging.suffix == ModelCheckpoint.FILE_EXTENSION and re.match(pattern, staging.stem))


def test_buckets_bound_size_and_gather_each_tied_parameter_once():
    a, b, big = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(32))
    named = [("a", a), ("a_tied", a), ("b", b), ("big", big), ("b2", b)]
    groups = buckets(named, bucket_bytes=32)  # a and b are 16 bytes each, big 128
    assert [[n for n, _ in g] for g in groups] == [["a", "a_tied", "b"], ["big"], ["b2"]]
    yielded = list(gather_in_buckets(named, bucket_bytes=32))  # plain parameters: nothing to gather
    assert [n for n, _ in yielded] == ["a", "a_tied", "b", "big", "b2"]
    assert all(t.data_ptr() == p.data_ptr() for (_, t), (_, p) in zip(yielded, named))
    with pytest.raises(ValueError, match="bucket_bytes"):
        buckets(named, 0)


@pytest.mark.parametrize("max_grad_norm", [0.0, None, 1e-3])
def test_max_grad_norm_0_does_not_clip_and_the_weights_change(tiny_model_dir, max_grad_norm):
    """0 means no clipping (TRL's and transformers' meaning), as None; it used to zero every gradient."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from arctic_rl.modules.models import build_causal_lm
    from arctic_rl.strategies.arctic import guarded_step

    model = build_causal_lm(str(tiny_model_dir), "float32")
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    unclipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    norm, skipped = guarded_step(SingleDeviceStrategy(torch.device("cpu")), model, optimizer, max_grad_norm)
    assert norm == pytest.approx(float(unclipped)) and norm > 0 and not skipped
    after_clip = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    assert float(after_clip) == pytest.approx(float(unclipped) if not max_grad_norm else max_grad_norm, rel=1e-4)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_lora_with_zero3_is_refused_before_any_model_naming_both_fields():
    from arctic_rl.errors import ConfigError
    from arctic_rl.modules.lora import LoraOptions, check_lora_strategy

    with pytest.raises(ConfigError, match=r"model\.lora\.rank=4 needs ZeRO stage 1 or 2 .* runs ZeRO stage 3 \(init_args\.stage"):
        check_lora_strategy(LoraOptions(rank=4), ArcticStrategy(stage=3))
    with pytest.raises(ConfigError, match="runs ZeRO stage 3"):  # stage 3 set through the raw DeepSpeed config
        check_lora_strategy(LoraOptions(rank=4), ArcticStrategy(stage=2, config={"zero_optimization": {"stage": 3}}))
    for stage in (1, 2):
        check_lora_strategy(LoraOptions(rank=4), ArcticStrategy(stage=stage))
    check_lora_strategy(LoraOptions(), ArcticStrategy(stage=3))  # no LoRA: every stage


def test_trainable_only_load_takes_exactly_the_trainable_weights():
    """``load_trainable`` (DeepSpeed's custom_load_fn for LoRA checkpoints): a tied frozen head counts as frozen under
    both names; a missing or extra tensor is refused naming model.lora; the loaded values are the checkpoint's."""
    from arctic_rl.errors import ConfigError
    from arctic_rl.strategies.arctic import frozen_names, load_trainable

    module = torch.nn.Module()
    module.embed, module.head, module.adapter = torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False), torch.nn.Linear(2, 2)
    module.head.weight = module.embed.weight  # tied
    module.embed.weight.requires_grad_(False)
    assert frozen_names(module) == {"embed.weight", "head.weight"}
    saved = {"adapter.weight": torch.ones(2, 2), "adapter.bias": torch.full((2,), 3.0)}
    load_trainable(saved, module)
    assert torch.equal(module.adapter.weight, saved["adapter.weight"]) and torch.equal(module.adapter.bias, saved["adapter.bias"])
    with pytest.raises(ConfigError, match=r"not this model's trainable ones \(model\.lora: its adapters\): missing \['adapter\.bias'\], unexpected \[\]"):
        load_trainable({"adapter.weight": torch.ones(2, 2)}, module)
    with pytest.raises(ConfigError, match=r"unexpected \['head\.weight'\]"):  # a checkpoint with the frozen weights in it
        load_trainable({**saved, "head.weight": torch.zeros(4, 2)}, module)
