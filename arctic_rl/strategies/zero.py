"""ZeRO-3 parameter access with bounded memory: gather full parameters a bucket at a time, copy one
model into another, build a consolidated state dict for ``save_pretrained``.

Every function also takes ordinary (unpartitioned) parameters, where it gathers nothing, so callers
need no branch on the strategy. Under ZeRO-3 they are collectives: every rank must call them and
iterate them to the end, in the same order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def is_partitioned(param: torch.Tensor) -> bool:
    """True for a parameter that ``deepspeed.zero.Init`` partitioned (ZeRO-3): it carries ``ds_id``."""
    return hasattr(param, "ds_id")


def full_nbytes(param: torch.Tensor) -> int:
    """Bytes of the whole parameter, also when only a shard (or nothing) of it is resident."""
    numel = param.ds_numel if is_partitioned(param) else param.numel()
    return numel * param.element_size()


def buckets(named_params: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of ``(name, param)`` whose distinct parameters total at most ``bucket_bytes``
    (a parameter larger than a bucket goes alone). A parameter listed twice (tied weights) counts once
    and stays in one bucket with its aliases only if they are adjacent; otherwise it is gathered again."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    groups: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    size = 0
    for name, param in named_params:
        extra = 0 if id(param) in seen else full_nbytes(param)
        if current and size + extra > bucket_bytes:
            groups.append(current)
            current, seen, size = [], set(), 0
            extra = full_nbytes(param)
        current.append((name, param))
        seen.add(id(param))
        size += extra
    if current:
        groups.append(current)
    return groups


def gather_in_buckets(named_params: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for each pair. ZeRO-3 parameters are all-gathered one bucket of at
    most ``bucket_bytes`` at a time and re-partitioned before the next bucket is gathered, so the extra
    memory is one bucket, never the model.

    A yielded tensor is only valid until the next one is requested: clone it to keep it. Under ZeRO-3
    this is a collective (every rank must exhaust the iterator)."""
    if not any(is_partitioned(p) for _, p in named_params):
        for name, param in named_params:
            yield name, param.detach()
        return
    import deepspeed

    for group in buckets(named_params, bucket_bytes):
        distinct = list({id(p): p for _, p in group}.values())
        with deepspeed.zero.GatheredParameters(distinct, modifier_rank=None):  # read-only: no re-scatter
            for name, param in group:
                yield name, param.data


def copy_parameters(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``target``'s parameters := ``source``'s (same architecture), one parameter pair gathered at a time."""
    pairs = list(zip(source.parameters(), target.parameters(), strict=True))
    if not any(is_partitioned(s) or is_partitioned(t) for s, t in pairs):
        with torch.no_grad():
            for s, t in pairs:
                t.copy_(s)
        return
    import deepspeed

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for s, t in pairs:
        # modifier_rank=0: rank 0 writes the full tensor, which is re-partitioned to every rank on exit
        with deepspeed.zero.GatheredParameters([s, t], modifier_rank=0), torch.no_grad():
            if rank == 0:
                t.data.copy_(s.data)


def consolidated_state_dict(model: torch.nn.Module, bucket_bytes: int) -> dict[str, torch.Tensor]:
    """Full CPU state dict of ``model`` for ``save_pretrained(state_dict=...)``: parameters gathered a
    bucket at a time (a tied parameter once, under its first name, as ``save_pretrained`` writes it),
    then the persistent buffers (never partitioned)."""
    state = {name: tensor.to("cpu", copy=True) for name, tensor in gather_in_buckets(list(model.named_parameters()), bucket_bytes)}
    param_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name, tensor in model.state_dict().items():
        if name not in param_names:
            state[name] = tensor.to("cpu", copy=True)
    return state


def build_partitioned_causal_lm(model: str | dict[str, Any], dtype: str) -> torch.nn.Module:
    """A transformers causal LM under ZeRO-3, for ``configure_model`` (Lightning's ``deepspeed.zero.Init``
    is active there): the model is created with every parameter partitioned as its module is built, so
    no rank ever holds the whole model, then its weights are written a bucket at a time on rank 0 and
    scattered: read from the directory's safetensors, or (a config dict) initialised as transformers
    initialises them. transformers' own ZeRO-3 loading path (``HfDeepSpeedConfig``) needs accelerate,
    which this project does not depend on."""
    from transformers import AutoModelForCausalLM

    from arctic_rl.causal_lm import causal_lm_config

    config = causal_lm_config(model)
    net = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if not all(is_partitioned(p) for p in net.parameters()):
        raise RuntimeError("build_partitioned_causal_lm must run inside deepspeed.zero.Init (ArcticStrategy stage 3, configure_model)")
    if isinstance(model, dict):
        _initialise_gathered(net)
    else:
        _load_gathered(net, Path(model))
    return net


def _load_gathered(net: torch.nn.Module, directory: Path, bucket_bytes: int = 256 << 20) -> None:
    """Copy the safetensors weights of ``directory`` into ZeRO-3 parameters (names must match 1:1, as in
    checkpoints written by transformers ``save_pretrained``)."""
    import deepspeed
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    elif (directory / "model.safetensors").is_file():
        with safe_open(directory / "model.safetensors", "pt") as f:
            weight_map = {name: directory / "model.safetensors" for name in f.keys()}
    else:
        raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json to load under ZeRO-3")
    named = list(net.named_parameters())
    missing = [name for name, _ in named if name not in weight_map]
    if missing:
        raise KeyError(f"{directory}: checkpoint lacks {missing[:5]} (ZeRO-3 loading maps parameter names 1:1)")
    is_rank0 = torch.distributed.get_rank() == 0
    for group in buckets(named, bucket_bytes):
        with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=0), torch.no_grad():
            if is_rank0:
                for name, param in group:
                    with safe_open(weight_map[name], "pt") as f:
                        param.data.copy_(f.get_tensor(name))


def _initialise_gathered(net: torch.nn.Module) -> None:
    """transformers' weight init (``_init_weights``) run module by module on gathered parameters on rank 0
    (under ``zero.Init`` it ran on empty shards and did nothing), then scattered."""
    import deepspeed

    is_rank0 = torch.distributed.get_rank() == 0
    for module in net.modules():
        params = list(module.parameters(recurse=False))
        if params:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
                if is_rank0:
                    net._init_weights(module)


def save_pretrained_consolidated(model: torch.nn.Module, tokenizer, directory: str | None, bucket_bytes: int) -> None:
    """``save_pretrained`` of ``model`` and ``tokenizer`` into ``directory``; ZeRO-3 parameters are consolidated
    into CPU memory ``bucket_bytes`` at a time (a collective: every rank calls it). ``directory`` None: only take
    part in that collective and write nothing (another rank writes)."""
    partitioned = any(is_partitioned(p) for p in model.parameters())
    if directory is None:
        for _ in gather_in_buckets(list(model.named_parameters()), bucket_bytes) if partitioned else ():
            pass  # the same gathers as consolidated_state_dict's, nothing kept
        return
    if partitioned:
        model.save_pretrained(directory, state_dict=consolidated_state_dict(model, bucket_bytes))
    else:
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
