"""GRPOModule's option sections (``modules/options.py``): each section's own checks, the rules between
sections (``validation.check_settings``), and the old flat keys, read with a warning naming the new key
(``modules/flat_options.py``) from Python, from a config file and from the command line."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import yaml

from arctic_rl.errors import ConfigError
from arctic_rl.modules.corrections import CorrectionConfig
from arctic_rl.modules.flat_options import (FLAT_KEYS, DeprecatedOptionKey, dotted_options, nest_flat_options, upgrade_args,
                                            upgrade_config)
from arctic_rl.modules.losses import LossConfig, Regularizers
from arctic_rl.modules.options import (SECTIONS, ComputeOptions, ModuleOptions, OptimOptions, RefSyncOptions, RolloutOptions,
                                       SamplingOptions)
from arctic_rl.rollout.rewards import OverlongBuffer
from tests.helpers import REPO, quickstart_config, write_config

TINY = {"model_type": "qwen3", "vocab_size": 33, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 128,
        "tie_word_embeddings": True}
SHORT = SamplingOptions(max_prompt_length=32, max_response_length=8)


def module(**kwargs):
    from arctic_rl.tasks.toy import EchoDigitGRPO

    return EchoDigitGRPO(model=TINY, tokenizer=str(REPO / "data/toy/tokenizer"), **kwargs)


def test_every_field_name_is_unique_over_the_sections():
    names = [f for cls in SECTIONS.values() for f in cls.__dataclass_fields__]
    assert len(names) == len(set(names)) == len(FLAT_KEYS)
    assert FLAT_KEYS["temperature"] == "sampling" and FLAT_KEYS["micro_batch_tokens"] == "compute"
    assert FLAT_KEYS["loss_aggregation"] == "loss" and FLAT_KEYS["kl_coef"] == "regularizers"


@pytest.mark.parametrize("build,message", [
    (lambda: SamplingOptions(group_size=1), r"^model.sampling.group_size must be >= 2 \(GRPO compares samples within a group\), got 1$"),
    (lambda: SamplingOptions(temperature=float("nan")), r"^model.sampling.temperature must be > 0, got nan$"),
    (lambda: SamplingOptions(max_prompt_length=0), r"^model.sampling.max_prompt_length must be >= 1, got 0$"),
    (lambda: OptimOptions(num_iterations=0), r"^model.optim.num_iterations must be >= 1, got 0$"),
    (lambda: OptimOptions(max_grad_norm=-1.0), r"^model.optim.max_grad_norm must be a finite number in \[0.0, inf\], got -1.0$"),
    (lambda: ComputeOptions(micro_batch_size=2, micro_batch_tokens=64),
     r"^set model.compute.micro_batch_size or model.compute.micro_batch_tokens, not both$"),
    (lambda: ComputeOptions(micro_batch_tokens=0), r"^model.compute.micro_batch_tokens must be >= 1, got 0$"),
    (lambda: RolloutOptions(reward_call_timeout_s=0.0),
     r"^model.rollout.reward_call_timeout_s must be a finite number in \(0.0, inf\], got 0.0$"),
    (lambda: RolloutOptions(multi_objective_aggregation="normalize_then_sum", advantage_estimator="rloo"),
     r"leave model.rollout.advantage_estimator 'grpo' and model.rollout.scale_rewards 'group'$"),
    (lambda: RolloutOptions(dynamic_sampling={"max_num_gen_batches": 0}),  # as a checkpoint keeps it: a dict
     r"^model.rollout.dynamic_sampling.max_num_gen_batches must be >= 1, got 0$"),
    (lambda: RefSyncOptions(sync_ref_model=True, ref_model_mixup_alpha=1.5), r"^model.ref_sync.ref_model_mixup_alpha must be in \[0, 1\], got 1.5$"),
])
def test_each_section_checks_its_own_fields(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


@pytest.mark.parametrize("kwargs,message", [
    ({"rollout": RolloutOptions(overlong_buffer=OverlongBuffer(len=20))},
     r"^model.rollout.overlong_buffer.len=20 is longer than model.sampling.max_response_length=8$"),
    ({"ref_sync": RefSyncOptions(sync_ref_model=True)},
     r"^model.ref_sync.sync_ref_model needs the KL reference model: set model.regularizers.kl_coef > 0 \(TRL refuses beta=0 too\)$"),
    ({"loss": LossConfig(loss_type="vespo"), "corrections": CorrectionConfig(vllm_importance_sampling_correction=True)},
     r"^model.loss.loss_type 'vespo' needs model.corrections.vllm_importance_sampling_mode token_truncate or token_mask"),
    ({"loss": {"dual_clip": 0.5}}, r"^model.loss.dual_clip must be > 1 \(or None\), got 0.5$"),  # LossConfig's own check
    ({"corrections": {"top_entropy_quantile": 2.0}}, r"^model.corrections.top_entropy_quantile must be in \[0, 1\], got 2.0$"),
    ({"loss": {"dual_clip": float("nan")}}, r"^model.loss.dual_clip must be a finite number in \(1.0, inf\], got nan$"),
    ({"regularizers": Regularizers(kl_coef=-0.5)}, r"^model.regularizers.kl_coef must be a finite number in \[0.0, inf\], got -0.5$"),
])
def test_rules_between_sections_and_of_the_shared_classes_name_the_new_keys(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        module(sampling=SHORT, **kwargs)


def test_flat_keyword_arguments_warn_naming_the_new_key_and_build_the_same_module():
    new = module(sampling=SamplingOptions(max_prompt_length=32, max_response_length=8, temperature=0.7),
                 optim=OptimOptions(learning_rate=0.003, mini_batches=2), compute=ComputeOptions(micro_batch_size=4),
                 loss=LossConfig(cispo_max_ratio=3.0), regularizers=Regularizers(kl_coef=0.1))
    with pytest.warns(DeprecatedOptionKey) as caught:
        old = module(max_prompt_length=32, max_response_length=8, temperature=0.7, learning_rate=0.003, mini_batches=2,
                     micro_batch_size=4, loss_kwargs={"cispo_max_ratio": 3.0}, kl_coef=0.1)
    assert [str(w.message) for w in caught] == [
        f"GRPOModule argument {key} is deprecated and will be removed in the next release; use GRPOModule argument {new_key}"
        for key, new_key in [("max_prompt_length", "sampling.max_prompt_length"), ("max_response_length", "sampling.max_response_length"),
                             ("temperature", "sampling.temperature"), ("learning_rate", "optim.learning_rate"),
                             ("mini_batches", "optim.mini_batches"), ("micro_batch_size", "compute.micro_batch_size"),
                             ("loss_kwargs", "loss (its keys are loss's fields)"), ("kl_coef", "regularizers.kl_coef")]]
    assert dict(old.hparams) == dict(new.hparams)
    assert (old.loss_config, old.regularizers, old.corrections) == (new.loss_config, new.regularizers, new.corrections)
    assert (old.mini_batches, old.micro_batch_size, old.max_prompt_length) == (2, 4, 32)
    with pytest.raises(TypeError, match="GRPOModule got an unexpected keyword argument 'temprature'"):
        module(temprature=0.7)


def test_options_are_a_frozen_tree_and_hparams_keep_sections_as_dicts():
    m = module(sampling=SamplingOptions(max_prompt_length=32, max_response_length=8, temperature=0.7),
               rollout=RolloutOptions(overlong_buffer={"len": 4}))
    assert isinstance(m.options, ModuleOptions)
    assert (m.options.sampling.temperature, m.options.regularizers.kl_coef, m.options.compute.zorro,
            m.options.optim.learning_rate) == (0.7, 0.0, True, 1e-6)
    assert m.options.rollout.overlong_buffer == OverlongBuffer(len=4)  # a dict (as a config or checkpoint keeps it) typed
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.options.sampling = SamplingOptions()
    assert sorted(m.hparams) == sorted(["model", "tokenizer", "dtype", *SECTIONS])
    assert m.hparams["sampling"] == {"group_size": 8, "max_prompt_length": 32, "max_response_length": 8, "temperature": 0.7,
                                     "top_p": 1.0, "seed": 0}
    assert m.hparams["rollout"]["overlong_buffer"] == {"len": 4, "penalty_factor": 1.0}  # what checkpoints keep: no classes
    assert dict(m.hparams) == {"model": m.hparams["model"], "tokenizer": m.hparams["tokenizer"], "dtype": "float32",
                               **m.options.as_dict()}


def test_a_checkpoint_with_flat_hparams_loads(tmp_path):
    """A checkpoint of the last release keeps flat hyperparameters; ``load_from_checkpoint`` passes them back
    as keyword arguments: read with a warning, the same module as from the new form."""
    import torch

    from arctic_rl.tasks.toy import EchoDigitGRPO

    new = module(sampling=SamplingOptions(group_size=4, max_prompt_length=32, max_response_length=8),
                 optim=OptimOptions(learning_rate=0.003))
    flat = {"model": TINY, "tokenizer": str(REPO / "data/toy/tokenizer"), "group_size": 4, "max_prompt_length": 32,
            "max_response_length": 8, "learning_rate": 0.003, "dtype": "float32", "_class_path": "arctic_rl.tasks.toy.EchoDigitGRPO"}
    new.configure_model()
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": new.state_dict(), "hyper_parameters": flat, "pytorch-lightning_version": "2.6.6"}, path)
    with pytest.warns(DeprecatedOptionKey, match="use GRPOModule argument sampling.group_size"):
        old = EchoDigitGRPO.load_from_checkpoint(path, weights_only=False)
    assert dict(old.hparams) == dict(new.hparams)
    options = {k: v for k, v in flat.items() if k != "_class_path"}
    dotted = {f"{FLAT_KEYS[k]}.{k}" if k in FLAT_KEYS else k: v for k, v in options.items()}
    assert {k: dotted_options(dict(new.hparams))[k] for k in dotted} == dotted == dotted_options(options)  # what resume_policy compares


def test_upgrade_config_moves_flat_keys_into_sections_and_warns_naming_the_new_key():
    new = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    old = copy.deepcopy(new)
    init = old["model"]["init_args"]
    for section in SECTIONS:
        init.update(init.pop(section, {}))
    with pytest.warns(DeprecatedOptionKey) as caught:
        upgraded = upgrade_config(old)
    assert upgraded == new
    assert "model.init_args.temperature is deprecated and will be removed in the next release; use model.init_args.sampling.temperature" \
        in [str(w.message) for w in caught]
    both = copy.deepcopy(new)
    both["model"]["init_args"]["temperature"] = 0.5  # set in both places: an error naming both keys, before any warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ConfigError, match=r"^model.init_args.temperature and model.init_args.sampling.temperature both"
                                              r" set one option: keep only model.init_args.sampling.temperature "):
            upgrade_config(both)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert upgrade_config(copy.deepcopy(new)) == new  # the new form: no warning


def test_upgrade_args_renames_flat_flags():
    with pytest.warns(DeprecatedOptionKey, match="--model.init_args.kl_coef is deprecated .*use --model.init_args.regularizers.kl_coef"):
        args = upgrade_args(["fit", "--model.init_args.kl_coef", "0.1", "--model.temperature=0.5", "--trainer.max_steps", "3"])
    assert args == ["fit", "--model.init_args.regularizers.kl_coef", "0.1", "--model.sampling.temperature=0.5", "--trainer.max_steps", "3"]


def test_a_python_caller_giving_one_option_twice_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"^GRPOModule argument temperature and GRPOModule argument sampling.temperature both set"
                                          r" one option: keep only GRPOModule argument sampling.temperature "), \
            pytest.warns(DeprecatedOptionKey):
        module(temperature=1.3, sampling=SamplingOptions(max_prompt_length=32, max_response_length=8, temperature=0.7))
    with pytest.raises(ConfigError, match=r"^GRPOModule argument clip_high and GRPOModule argument loss_kwargs.clip_high both set"):
        nest_flat_options({"clip_high": 0.3, "loss_kwargs": {"clip_high": 0.5}})
    with pytest.warns(DeprecatedOptionKey, match="use GRPOModule argument sampling.temperature"):  # the section leaves it alone
        m = module(temperature=1.3, sampling=SamplingOptions(max_prompt_length=32, max_response_length=8))
    assert m.options.sampling.temperature == 1.3


def test_nest_flat_options_refuses_unknown_loss_kwargs():
    with pytest.raises(ConfigError, match=r"^model.loss_kwargs: unknown keys \['cispo_max_ration'\]"):
        nest_flat_options({"loss_kwargs": {"cispo_max_ration": 2.0}})


def test_an_old_flat_config_file_parses_to_the_new_form_with_warnings(toy_task, tmp_path):
    """``arctic-rl fit`` reads a config of the last release (flat ``model.init_args`` keys) and a flat flag,
    warning for each, into the same config as the new form."""
    from arctic_rl.cli import build_cli

    new = quickstart_config(toy_task, tmp_path)
    old = copy.deepcopy(new)
    init = old["model"]["init_args"]
    for section in SECTIONS:
        init.update(init.pop(section, {}))
    assert "temperature" in init and "sampling" not in init
    with pytest.warns(DeprecatedOptionKey, match="use model.init_args.sampling.max_response_length"):
        old_cli = build_cli(["--config", str(write_config(old, tmp_path / "old.yaml")), "--model.init_args.top_p", "0.9"], run=False)
    new_cli = build_cli(["--config", str(write_config(new, tmp_path / "new.yaml")), "--model.init_args.sampling.top_p", "0.9"],
                        run=False)
    assert old_cli.config.model.init_args.as_dict() == new_cli.config.model.init_args.as_dict()
    assert old_cli.model.options.sampling.top_p == 0.9 and dict(old_cli.model.hparams) == dict(new_cli.model.hparams)


def test_only_the_service_leaves_the_group_size_out_and_fit_refuses_it_at_setup():
    import lightning.pytorch as pl

    m = module(sampling=SamplingOptions(group_size=None, max_prompt_length=32, max_response_length=8))  # as the service builds it
    m.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ConfigError, match=r"^model.sampling.group_size must be >= 2 \(GRPO compares samples within a group\), got None$"):
        m.setup("fit")
