"""LoRA through ``peft`` (``model.init_args.lora``; the service's ``lora`` section): low-rank adapters on the
policy's linear layers, the base weights frozen.

The boundary is narrow. :func:`apply_lora` injects peft's LoRA layers into the transformers model in place
(``peft.inject_adapter_in_model``): the model stays the transformers model, so ZoRRo, the naive path, the
self-check and the head transform see it as before, and only the adapters (``lora_A``/``lora_B``) require grad.
What leaves the trainer leaves it merged: :func:`merged_named_tensors` turns the parameter stream into the base
model's names and tensors (``W + scaling * B @ A``), which is what every rollout engine loads (vLLM's
``reload_weights``, the transformers engine) and what ``save_policy`` writes. Checkpoints keep the adapters only
(:func:`adapter_only`); the base is rebuilt from ``model.model`` on resume.

``peft`` is imported only when a model gets adapters (the ``lora`` extra: ``pip install 'arctic-rl[lora]'``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from arctic_rl.errors import ConfigError
from arctic_rl.options.lora import LoraOptions

ADAPTER = "default"  # peft's adapter name; one adapter per model
ADAPTER_MARKERS = (".lora_A.", ".lora_B.")
BASE_LAYER = ".base_layer"


def require_peft():
    """The ``peft`` module, or a ``ConfigError`` naming the extra that installs it."""
    try:
        import peft
    except ImportError as e:
        raise ConfigError(f"model.lora.rank > 0 needs peft: pip install 'arctic-rl[lora]' ({e})") from None
    return peft


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The last name part of every ``nn.Linear`` of ``model``'s decoder (not the output head), in order, once each."""
    head = model.get_output_embeddings()
    names: dict[str, None] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head and BASE_LAYER not in name:
            names[name.rsplit(".", 1)[-1]] = None
    return list(names)


def check_targets(model: torch.nn.Module, options: LoraOptions) -> list[str]:
    """The module names that get adapters; a ``ConfigError`` naming ``model.lora.target_modules`` for a name
    that is no linear layer of the decoder."""
    known = linear_layer_names(model)
    targets = known if options.target_modules is None else list(options.target_modules)
    unknown = [name for name in targets if name not in known]
    if unknown:
        raise ConfigError(f"model.lora.target_modules: {unknown} name no linear layer of the decoder; "
                          f"its linear layers are {', '.join(known)}")
    return targets


def check_lora_settings(model_source: str | dict[str, Any], options: LoraOptions, sync_ref_model: bool) -> None:
    """Before any model is built: peft is installed, the targets exist (on a model built on the meta device,
    no memory) and the options that do not combine with adapters are off."""
    if not options.enabled:
        return
    require_peft()
    if sync_ref_model:
        raise ConfigError("model.ref_sync.sync_ref_model mixes the policy's weights into the reference; with "
                          "model.lora.rank > 0 the policy's are the base's plus adapters: turn one off")
    from transformers import AutoModelForCausalLM

    from arctic_rl.causal_lm import causal_lm_config

    with torch.device("meta"):
        check_targets(AutoModelForCausalLM.from_config(causal_lm_config(model_source)), options)


def check_lora_strategy(options: LoraOptions, strategy: Any) -> None:
    """LoRA runs with plain torch or DeepSpeed ZeRO stage 1 or 2: a ``ConfigError`` naming ``model.lora.rank`` and
    the strategy's stage for ZeRO-3, before any model is built."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if options.enabled and isinstance(strategy, DeepSpeedStrategy) and strategy.zero_stage_3:
        raise ConfigError(f"model.lora.rank={options.rank} needs ZeRO stage 1 or 2 (or no DeepSpeed), but trainer.strategy "
                          f"({type(strategy).__name__}) runs ZeRO stage 3 (init_args.stage / zero_optimization.stage), whose "
                          "partitioned parameters peft cannot wrap: set the stage to 1 or 2, or model.lora.rank: 0")


def apply_lora(model: torch.nn.Module, options: LoraOptions) -> torch.nn.Module:
    """Inject ``options``' adapters into ``model`` in place (``peft.inject_adapter_in_model``): ``lora_B`` starts
    at zero, so the model computes what it did; the base weights no longer require grad. Returns ``model``."""
    from arctic_rl.strategies.zero import is_partitioned

    if any(is_partitioned(p) for p in model.parameters()):
        raise ConfigError("model.lora.rank > 0 runs with plain torch or DeepSpeed ZeRO stage 1 or 2, not ZeRO stage 3 "
                          "(its partitioned parameters would get adapters initialised on empty shards)")
    peft = require_peft()
    config = peft.LoraConfig(r=options.rank, lora_alpha=options.rank if options.alpha is None else options.alpha,
                             target_modules=check_targets(model, options), lora_dropout=0.0, bias="none")
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    return model


def is_adapter(name: str) -> bool:
    return any(marker in name for marker in ADAPTER_MARKERS)


def has_adapters(model: torch.nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in model.named_parameters())


def lora_scalings(model: torch.nn.Module) -> dict[str, float]:
    """``{module name: scaling}`` of every LoRA layer of ``model`` (peft's ``alpha / r``)."""
    return {name: module.scaling[ADAPTER] for name, module in model.named_modules()
            if isinstance(getattr(module, "scaling", None), dict) and ADAPTER in module.scaling}


def merged_named_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` (a stream of ``model``'s parameters, e.g. ``gather_in_buckets``') with the adapters merged in:
    each LoRA layer's weight under its base name (``q_proj.weight = W + scaling * B @ A``, computed in at least
    float32 and cast to ``W``'s dtype), its bias under its base name, no adapter tensors. The base weight of a layer is
    held (cloned) until its adapters arrive, since a stream's tensor may be valid only until the next."""
    scalings = lora_scalings(model)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        layer, kind = _layer_and_kind(name)
        if layer is None or layer not in scalings:
            yield name, tensor
            continue
        if kind == "bias":
            yield f"{layer}.bias", tensor
            continue
        parts = pending.setdefault(layer, {})
        parts[kind] = tensor.detach().clone()
        if len(parts) == 3:
            del pending[layer]
            weight, a, b = parts["weight"], parts["A"], parts["B"]
            wide = torch.promote_types(weight.dtype, torch.float32)  # bf16 / fp16 merged in float32
            delta = (b.to(wide) @ a.to(wide)) * scalings[layer]
            yield f"{layer}.weight", (weight.to(wide) + delta).to(weight.dtype)
    if pending:
        raise RuntimeError(f"LoRA layers {sorted(pending)[:3]} lacked their base weight or adapters in the parameter stream")


def _layer_and_kind(name: str) -> tuple[str | None, str]:
    """``("model.layers.0.self_attn.q_proj", "weight" | "bias" | "A" | "B")`` of a LoRA layer's parameter; None otherwise."""
    for marker, kind in ((".lora_A.", "A"), (".lora_B.", "B")):
        if marker in name:
            return name.split(marker)[0], kind
    if f"{BASE_LAYER}." in name:
        layer, leaf = name.rsplit(f"{BASE_LAYER}.", 1)
        return layer, leaf
    return None, ""


def adapter_only(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The adapter entries of a module's ``state_dict`` (what a LoRA checkpoint keeps)."""
    return {name: value for name, value in state_dict.items() if is_adapter(name)}


def check_adapter_checkpoint(state_dict: dict[str, Any], expected: Iterable[str]) -> None:
    """A LoRA checkpoint's ``state_dict`` must hold exactly the adapters the model has (names as the module's)."""
    have, want = set(state_dict), set(expected)
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        raise ConfigError(f"the checkpoint's weights are not this model's LoRA adapters (model.lora): missing {missing[:3]}"
                          f"{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")


def save_merged(model: torch.nn.Module, tokenizer, directory: str, merged: Iterable[tuple[str, torch.Tensor]]) -> None:
    """``save_pretrained`` of the merged weights ``merged`` (:func:`merged_named_tensors`) and ``tokenizer`` into
    ``directory``: a plain transformers model of the base's architecture, as the engines load it."""
    head = model.get_output_embeddings()
    tied = {f"{name}.weight" for name, module in model.named_modules() if module is head} \
        if model.config.get_text_config().tie_word_embeddings else set()  # written once, as save_pretrained does
    state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in merged if name not in tied}
    for name, tensor in model.state_dict().items():  # persistent buffers, if any, under their own names
        if not is_adapter(name) and BASE_LAYER not in name and name not in state and name not in tied:
            state[name] = tensor.detach().to("cpu", copy=True)
    model.save_pretrained(directory, state_dict=state)
    tokenizer.save_pretrained(directory)
