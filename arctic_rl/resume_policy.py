"""What ``--ckpt_path`` does with a config that differs from the checkpoint's hyperparameters.

The run's config (YAML plus command line) is what the resumed run uses and what its saved
``config.yaml`` says; the checkpoint's hyperparameters are only compared with it (LightningCLI's
default, silently replacing ``model.init_args`` with the checkpoint's, is switched off):

- values a resume cannot honour are refused before anything starts: :data:`FIXED_ON_RESUME`
  (``sampling.group_size``, the model and tokenizer, ``dtype``), turning the KL reference model on or off, and
  a change of the LoRA adapters' shape (``model.lora.rank`` or ``target_modules``, or LoRA on or off: a LoRA
  checkpoint holds the adapters only), this last as one line naming ``model.lora``;
- every other change (``learning_rate``, ``kl_coef``, ``temperature``, ...) is applied, and each one is
  printed as a warning. ``learning_rate`` and ``weight_decay`` are pushed into the restored optimizer
  and LR scheduler (whose saved state would otherwise keep the old values) by
  ``callbacks/optimizer_follows_config.py``.

The data position is checked by the prompt loader itself (batch size, seed, shuffle, ranks).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

FIXED_ON_RESUME = ("model", "tokenizer", "sampling.group_size", "dtype")  # names under model.init_args
_NOT_ARGUMENTS = ("_class_path", "_instantiator")


def checkpoint_hparams(ckpt_path: str | Path) -> dict[str, Any]:
    """The module hyperparameters saved in a checkpoint file, or in a DeepSpeed checkpoint directory."""
    path = Path(ckpt_path)
    if not path.exists():  # "last"/"best" (Lightning resolves them), or a missing file (Lightning's error)
        return {}
    if path.is_dir():
        states = sorted(path.glob("checkpoint/*model_states.pt"))
        if not states:
            return {}
        path = states[0]
    checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return {k: v for k, v in checkpoint.get("hyper_parameters", {}).items() if k not in _NOT_ARGUMENTS}


def compare(saved: dict[str, Any], configured: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(refused, applied)``: one line per ``model.init_args`` value that differs from the checkpoint. Either
    side may have the options in sections or flat (a checkpoint of the last release): they are compared field
    by field and named by their place in a section."""
    from arctic_rl.modules.flat_options import dotted_options

    saved, configured = dotted_options(saved), dotted_options(configured)
    refused, applied = [], []
    for name in sorted(set(saved) & set(configured)):
        old, new = saved[name], configured[name]
        if old == new:
            continue
        line = f"model.init_args.{name}: {old!r} in the checkpoint, {new!r} in this run's config"
        kl_toggled = name == "regularizers.kl_coef" and (old > 0) != (new > 0)  # adds or removes the reference model
        (refused if name in FIXED_ON_RESUME or kl_toggled else applied).append(line)
    return refused, applied


def check_resume_config(ckpt_path: str | Path, configured: dict[str, Any]) -> None:
    """Refuse (``ConfigError``) or announce the differences between ``configured`` (the run's
    ``model.init_args``) and the checkpoint's hyperparameters."""
    from arctic_rl.errors import ConfigError

    saved = checkpoint_hparams(ckpt_path)
    lora = lora_change(saved, configured)
    if lora:
        raise ConfigError(f"cannot resume from {ckpt_path}: {lora}")
    refused, applied = compare(saved, configured)
    if refused:
        raise ConfigError(
            f"cannot resume from {ckpt_path}: these values differ from the ones it was trained with, and a"
            " resumed run cannot change them:\n  " + "\n  ".join(refused) + "\nSet them back, or start a new run"
            " (without --ckpt_path) from exported weights (model.init_args.model: <save_pretrained directory>)."
        )
    for line in applied:
        print(f"arctic-rl: WARNING: resuming with a changed hyperparameter (applied): {line}", file=sys.stderr, flush=True)


def lora_change(saved: dict[str, Any], configured: dict[str, Any]) -> str | None:
    """Why the checkpoint's weights cannot load into this run's ``model.lora`` (None: they can). A checkpoint
    without ``lora`` (of a release before it) holds full weights."""
    from arctic_rl.modules.flat_options import dotted_options

    old, new = dotted_options(saved), dotted_options(configured)
    old_rank, new_rank = old.get("lora.rank") or 0, new.get("lora.rank") or 0
    start_new = "or start a new run (without --ckpt_path) from its exported weights (model.init_args.model)"
    if old_rank and not new_rank:
        shown = {"rank": old_rank, "alpha": old.get("lora.alpha"), "target_modules": old.get("lora.target_modules")}
        return (f"it holds LoRA adapters only (model.lora.rank {old_rank}), and this run's config has no LoRA"
                f" (model.lora.rank 0); set model.lora to the checkpoint's {shown} to resume, {start_new}")
    if new_rank and not old_rank:
        return (f"it holds full weights (no LoRA), and this run's config adds LoRA (model.lora.rank {new_rank});"
                f" remove model.lora to resume, {start_new}")
    if old_rank != new_rank:
        return (f"its LoRA adapters have model.lora.rank {old_rank}, this run's config {new_rank}; set"
                f" model.lora.rank back to {old_rank} to resume, {start_new}")
    if old_rank and old.get("lora.target_modules") != new.get("lora.target_modules"):
        return (f"its LoRA adapters are on model.lora.target_modules {old.get('lora.target_modules')}, this run's config"
                f" {new.get('lora.target_modules')}; set them back to resume, {start_new}")
    return None
