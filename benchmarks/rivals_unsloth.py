"""unsloth's PrefixGrouper port (the ``unsloth`` / ``unsloth_zoo`` packages) as a side of ``benchmarks/rivals_gpu.py``.

The step runs unsloth's own code the way its GRPO loss does on the grad path (``unsloth_zoo.rl_replacements``,
``UNSLOTH_GRPO_PREFIX_GROUPER`` on, the default): ``unsloth.utils.prefix_grouper.build_group_layout`` turns the
left-padded GRPO rows into one flat stream (each group's prompt once, then its completions, positions continuing from
the prompt) with a ``PrefixSegInfo`` segment table; the model runs that stream with the table in its attention kwargs,
and its attention is ``unsloth.utils.prefix_grouper_kernel.flex_shared_prefix_attention`` (a ``torch.compile``d
FlexAttention over a shared-prefix block mask), called as unsloth's ``attention_dispatch`` calls it;
``GroupLayout.extract_logps`` gathers the predicting rows' hidden states and scores them with unsloth_zoo's
``chunked_hidden_states_selective_log_softmax`` (the lm head on the completion rows only).

Wiring, the only code of ours: the transformers attention function that hands Q/K/V to unsloth's kernel (unsloth's own
route is its patched Llama/Qwen3 attention forward, which ``FastLanguageModel`` installs into transformers' classes for
the whole process, and so into the other sides' models too), the call of ``model.model`` for the hidden states
(unsloth's forward returns them under ``UNSLOTH_RETURN_HIDDEN_STATES=1``), and the GRPO rows it starts from.

Imports: ``import unsloth`` starts unsloth's GPU stack (it patches transformers, TRL and torch functions process-wide
and needs unsloth_zoo's device checks) and, on a machine without a GPU, falls back to its CPU backend, after which
``unsloth.utils`` fails on a circular import (``utils/__init__`` -> ``attention_dispatch`` -> ``models`` -> ``llama``
-> ``utils.attention_dispatch``) unless ``unsloth.models`` is imported first. The two modules of the port import only
torch, so the benchmark loads them (and unsloth_zoo's ``rl_replacements``) from the installed packages without running
the packages' ``__init__``: no process-wide patches, the same code on the CPU and the GPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile
import types

import torch

UNSLOTH_ATTENTION = "arctic_rl_benchmark_unsloth_prefix_grouper"
_state: dict = {}


def _package_without_init(name: str) -> None:
    """Make ``name`` importable as a package whose ``__init__`` is not run (its submodules import normally)."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__file__ = spec.origin
    sys.modules[name] = module


def _modules():
    if not _state:  # unsloth_zoo writes generated modules under this (default: ./unsloth_compiled_cache)
        os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", os.path.join(tempfile.gettempdir(), "unsloth_compiled_cache"))
        for name in ("unsloth", "unsloth.utils", "unsloth_zoo"):
            _package_without_init(name)
        _state["pg"] = importlib.import_module("unsloth.utils.prefix_grouper")
        _state["kernel"] = importlib.import_module("unsloth.utils.prefix_grouper_kernel")
        _state["rl"] = importlib.import_module("unsloth_zoo.rl_replacements")
    return _state["pg"], _state["kernel"], _state["rl"]


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, prefix_seg_info=None, **kwargs):
    """transformers attention function: Q/K/V ``[1, H, T, D]`` through unsloth's shared-prefix kernel."""
    _, kernel, _ = _modules()
    out = kernel.flex_shared_prefix_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                              prefix_seg_info, scale=scaling, compiled=query.is_cuda)
    return out, None  # [1, T, H, D], as transformers' attention functions return it


def register_unsloth() -> str:
    """Load the port and register the attention name; the package version."""
    from importlib.metadata import version

    from transformers import AttentionInterface

    _modules()
    AttentionInterface.register(UNSLOTH_ATTENTION, _attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(UNSLOTH_ATTENTION, lambda *args, **kwargs: None)  # the kernel's block mask
    except ImportError:
        pass
    return f"unsloth {version('unsloth')}, unsloth_zoo {version('unsloth_zoo')}"


def unsloth_response_logprobs(model, prompts, response_ids, response_mask, temperature, _entropy=False, _k=0, **_):
    """Response log-probs ``[N, R]`` through unsloth's PrefixGrouper layout, kernel and log-prob extraction."""
    pg, _, rl = _modules()
    n, width = response_ids.shape
    device = response_ids.device
    groups = 1 + sum(1 for a, b in zip(prompts, prompts[1:]) if a is not b)
    if n % groups or any(prompts[i] is not prompts[i - i % (n // groups)] for i in range(n)):
        raise ValueError("unsloth's PrefixGrouper takes groups of num_generations consecutive rows of one prompt")
    # GRPO rows as unsloth's trainer holds them: the prompt left-padded to the longest, the completion right-padded
    longest = max(len(p) for p in prompts)
    left = torch.tensor([longest - len(p) for p in prompts], device=device)
    prompt_ids = torch.zeros(n, longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, longest - len(p):] = torch.tensor(p)
    input_ids = torch.cat([prompt_ids.to(device), response_ids * response_mask.long()], dim=1)
    layout = pg.build_group_layout(input_ids, width, 0, n // groups, left)
    if layout is None:
        raise ValueError("unsloth's build_group_layout declined the batch (it falls back to its packed path)")
    hidden = model.model(input_ids=layout.flat_ids, position_ids=layout.position_ids,
                         prefix_seg_info=layout.prefix_seg_info, use_cache=False).last_hidden_state
    chunks = max(1, n)  # unsloth's grad path: total_rows * multiplier chunks
    logprobs = layout.extract_logps(hidden, model.lm_head.weight, rl.chunked_hidden_states_selective_log_softmax,
                                    chunks, 0.0, 0.0, 0.0, temperature)
    return logprobs[:, -width:] * response_mask, None
