"""The checks of ``GRPOModule``'s settings made in its constructor beyond each section's own (``options.py``),
before any model, data or engine exists: each bad value is a :class:`~arctic_rl.errors.ConfigError` naming
``model.<section>.<key>``, which
``arctic-rl`` prints as one line with exit status 2.

A value that trains without error but wrongly is refused here too: a negative ``max_grad_norm``
flips the update, ``clip_low >= 1`` removes the lower clip, a negative ``kl_coef`` or
``warmup_steps`` would be silently ignored, and a NaN anywhere only fails at the first loss.
"""

from __future__ import annotations

from typing import Any

from arctic_rl.errors import ConfigError, check_model_path, check_number
from arctic_rl.options import CorrectionConfig, LossConfig, ModuleOptions, Regularizers

DTYPES = ("float32", "bfloat16", "float16", "float64")  # the trainer's; float64 also needs engine: transformers (rollout/engines/factory.py)


def check_settings(model: str | dict[str, Any], tokenizer: str | None, dtype: str, options: ModuleOptions) -> None:
    """The checks of ``GRPOModule.__init__``'s arguments that no one section makes (each section checks its own
    fields when built, ``options.py``) and that need no data or trainer: the model and tokenizer, ``dtype``,
    the loss and regularisers (their classes are shared with the service, which checks them its own way) and
    the pairs of sections. ``options``: the sections (``options.ModuleOptions``), built."""
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_loss_settings(options.loss, options.corrections, options.regularizers)
    if tokenizer is None and not isinstance(model, str):
        raise ConfigError("model.tokenizer is required when model.model is a config dict")
    for field, source in (("model.model", model), ("model.tokenizer", tokenizer)):
        check_model_path(field, source)
    check_context_length(model, options.sampling.max_prompt_length, options.sampling.max_response_length)
    check_tree_dedup(model, options.compute)
    check_sequence_parallel_model(model, options.compute)
    if options.compute.sequence_parallel > 1 and options.corrections.router_replay:
        raise ConfigError(f"model.compute.sequence_parallel={options.compute.sequence_parallel} and "
                          "model.corrections.router_replay: the replay plan covers the whole packed row and is not split over "
                          "sequence-parallel ranks yet; use one of the two")
    buffer, limit = options.rollout.overlong_buffer, options.sampling.max_response_length
    if buffer is not None and buffer.len > limit:
        raise ConfigError(f"model.rollout.overlong_buffer.len={buffer.len} is longer than model.sampling.max_response_length={limit}")
    from arctic_rl.modules.lora import check_lora_settings  # peft installed, the targets exist, nothing that does not combine with adapters

    check_lora_settings(model, options.lora, options.ref_sync.sync_ref_model)
    if options.ref_sync.sync_ref_model and not options.regularizers.kl_coef > 0:
        raise ConfigError("model.ref_sync.sync_ref_model needs the KL reference model: set model.regularizers.kl_coef > 0"
                          " (TRL refuses beta=0 too)")


def check_loss_settings(loss: LossConfig, corrections: CorrectionConfig, regularizers: Regularizers) -> None:
    """The PPO clip range, the loss constants and the regularisers' weights (``LossConfig`` checked its
    ``loss_type`` against the loss registry when it was built)."""
    from arctic_rl.modules.corrections import correction_fits_loss

    check_number("loss.clip_low", loss.clip_low, 0.0, 1.0, high_open=True)  # ratio >= 1 - clip_low > 0
    check_number("loss.clip_high", loss.clip_high, 0.0)
    if loss.dual_clip is not None:  # LossConfig refuses <= 1; NaN too here
        check_number("loss.dual_clip", loss.dual_clip, 1.0, low_open=True)
    typed = {"loss_type", "importance_sampling_level", "clip_low", "clip_high", "dual_clip", "loss_aggregation"}
    for key in sorted(LossConfig.field_names() - typed):  # the loss types' constants
        check_number(f"loss.{key}", getattr(loss, key))
    check_number("regularizers.kl_coef", regularizers.kl_coef, 0.0)  # 0: no reference model
    check_number("regularizers.entropy_coef", regularizers.entropy_coef)
    if not correction_fits_loss(loss.loss_type, corrections.vllm_importance_sampling_correction,
                                corrections.vllm_importance_sampling_mode):
        raise ConfigError("model.loss.loss_type 'vespo' needs model.corrections.vllm_importance_sampling_mode"
                          " token_truncate or token_mask (as in TRL)")


def context_length(model: str | dict[str, Any]) -> int | None:
    """The model's ``max_position_embeddings`` from its config alone (a config dict, or the
    ``config.json`` of a directory or hub id), without building it."""
    from arctic_rl.modules.models import causal_lm_config

    return getattr(causal_lm_config(model).get_text_config(), "max_position_embeddings", None)  # None: the model has no such limit


def check_context_length(model: str | dict[str, Any], max_prompt_length: int, max_response_length: int) -> None:
    """A prompt plus its response must fit the model's positions (and the engine's ``max_model_len``)."""
    limit = context_length(model)
    if limit is not None and max_prompt_length + max_response_length > limit:
        raise ConfigError(
            f"model.sampling.max_prompt_length + model.sampling.max_response_length = {max_prompt_length} + {max_response_length}"
            f" = {max_prompt_length + max_response_length} exceeds the model's max_position_embeddings={limit};"
            " lower them so they fit"
        )


def check_tree_dedup(model: str | dict[str, Any], compute: Any) -> None:
    """``compute.zorro_dedup: tree`` needs a model without linear-attention layers (its per-segment states are
    threaded through one shared prompt only), read from the model's config before it is built."""
    if not (compute.zorro and compute.zorro_dedup == "tree"):
        return
    from arctic_rl.modules.models import causal_lm_config

    config = causal_lm_config(model)
    if "linear_attention" in (getattr(config.get_text_config(), "layer_types", None) or []):
        raise ConfigError(f"model.compute.zorro_dedup 'tree': model type '{config.model_type}' has linear-attention layers, whose"
                          " per-segment states ZoRRo threads through one shared prompt only: set model.compute.zorro_dedup: group")


def check_sequence_parallel_model(model: str | dict[str, Any], compute: Any) -> None:
    """``compute.sequence_parallel: N`` splits the query heads over N ranks (their count must divide by N) and cannot
    split linear-attention layers (their state runs along the whole sequence), read from the model's config."""
    if compute.sequence_parallel == 1:
        return
    from arctic_rl.modules.models import causal_lm_config

    config = causal_lm_config(model)
    text, degree = config.get_text_config(), compute.sequence_parallel
    if text.num_attention_heads % degree:
        raise ConfigError(f"model.compute.sequence_parallel={degree} splits attention heads over {degree} ranks; model type "
                          f"'{config.model_type}' has {text.num_attention_heads} query heads, not a multiple of {degree}")
    if "linear_attention" in (getattr(text, "layer_types", None) or []):
        raise ConfigError(f"model.compute.sequence_parallel={degree}: model type '{config.model_type}' has linear-attention "
                          "layers, whose recurrent state runs along the whole sequence and is not split; set it to 1")
