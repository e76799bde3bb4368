"""AReaL's tree training (the ``areal`` package) as a side of ``benchmarks/rivals_gpu.py``.

The step runs AReaL's own code the way its FSDP engine does with ``enable_tree_training`` (its
docs/en/reference/tree_training.md): ``build_packed_tree_batch`` packs the whole sequences (prompt + response) into a
trie (every shared prefix once: the prompt, and in multi-turn trees each shared turn), padded to ``max_tokens_per_mb``
(a multiple of 128); ``build_tree_attn_kwargs`` builds its FlexAttention block mask; the model runs with AReaL's
``patch_fsdp_for_tree_training`` in place (it swaps transformers' ``_flash_attention_forward`` for AReaL's tree
attention: a ``torch.compile``d ``flex_attention`` over the block mask); ``_gather_packed_tree_logprobs`` (what the
engine's forward-only path calls) takes every sequence's log-probs from the packed logits.

Wiring, the only code of ours: transformers reaches the patched function through its own
``integrations.flash_attention.flash_attention_forward`` (what ``attn_implementation="flash_attention_2"`` runs),
registered here under another name, because transformers refuses ``flash_attention_2`` without the ``flash_attn``
package, which the GPU image lacks (AReaL's tree function never calls flash_attn); and the response slice of each
sequence's log-probs. ``max_tokens_per_mb``: the batch's whole trie rounded up to 128 (one tree, the least padding
AReaL allows) when it holds at most 32,768 tokens, else 32,768 (AReaL's greedy packer fills several trees, each padded
to it); ``--areal-max-tokens`` sets it instead. As in AReaL's engine, each tree's backward runs before the next tree's
forward (the gradient of the summed response log-probs, accumulated; the function returns the log-probs detached).
AReaL computes the logits and log-probs of every token of the tree, prompts included (its ``_gather_logprobs``
keeps each chunk's fp32 log-softmax for the backward).

AReaL's import path: ``areal.models.tree_attn.tree`` imports ``areal.api.cli_args`` (for ``MicroBatchSpec``), which
imports the engine and its infrastructure package; with them come hydra-core, omegaconf, antlr4, colorlog, tenacity,
flask, torchdata, openai, orjson, lark, aiohttp, numba and uvloop at import time, although the tree code calls none of
them. ``scripts/gpu_wheels.sh rivals`` carries those the GPU image lacks.
"""

from __future__ import annotations

import math

import torch

AREAL_ATTENTION = "arctic_rl_benchmark_areal_tree"
_state: dict = {}


def register_areal() -> str:
    """Import AReaL's tree code, apply its FSDP patch and register the attention name; the package version."""
    if _state:
        return _state["version"]
    import areal
    from areal.models.tree_attn.module import patch_fsdp_for_tree_training
    from transformers import AttentionInterface
    from transformers.integrations import flash_attention

    patch_fsdp_for_tree_training(enable=True)  # AReaL: flash_attention._flash_attention_forward -> tree attention
    AttentionInterface.register(AREAL_ATTENTION, flash_attention.flash_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register(AREAL_ATTENTION, lambda *args, **kwargs: None)  # the block mask is AReaL's
    except ImportError:
        pass
    _state["version"] = getattr(areal, "__version__", "?")
    return _state["version"]


def _sequences(prompts, response_ids, response_mask):
    """AReaL's input: ``input_ids`` / ``attention_mask`` ``[N, P + R]``, each prompt + response, right-padded."""
    lengths = response_mask.sum(-1).long().tolist()
    rows = [list(p) + response_ids[i, : lengths[i]].tolist() for i, p in enumerate(prompts)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids.to(response_ids.device), mask.to(response_ids.device), lengths


MAX_TREE_TOKENS = 32768


def default_max_tokens(data: dict, block: int) -> int:
    """``max_tokens_per_mb``: the whole batch's trie when it holds at most ``MAX_TREE_TOKENS`` tokens (one tree, the
    least padding), else ``MAX_TREE_TOKENS`` (AReaL's greedy packer fills trees up to it), rounded up to ``block``."""
    from areal.models.tree_attn.tree import _greedy_build_tries

    _, counts = _greedy_build_tries(data, 1 << 62)  # AReaL's packer with no limit: one trie
    longest = int(data["attention_mask"].sum(-1).max())
    tokens = sum(counts) if sum(counts) <= MAX_TREE_TOKENS else max(MAX_TREE_TOKENS, longest)
    return math.ceil(tokens / block) * block


def areal_response_logprobs(model, prompts, response_ids, response_mask, temperature, _entropy=False, _k=0,
                            max_tokens: int = 0, **_):
    """Response log-probs ``[N, R]`` through AReaL's tree packing, tree attention and packed-tree log-probs."""
    from areal.api.cli_args import MicroBatchSpec
    from areal.models.tree_attn.constants import BLOCK_SIZE
    from areal.models.tree_attn.functional import _gather_packed_tree_logprobs
    from areal.models.tree_attn.module import build_tree_attn_kwargs
    from areal.models.tree_attn.tree import build_packed_tree_batch

    input_ids, attention_mask, lengths = _sequences(prompts, response_ids, response_mask)
    data = {"input_ids": input_ids, "attention_mask": attention_mask}
    limit = max_tokens or default_max_tokens(data, BLOCK_SIZE)
    mb_list = build_packed_tree_batch(data, MicroBatchSpec(max_tokens_per_mb=limit), pad_to_maximum=True)
    width = response_ids.shape[1]
    rows: dict[int, torch.Tensor] = {}
    training = torch.is_grad_enabled()
    for mb, padded in zip(mb_list.mbs, mb_list.padded_to_lengths):
        trie = mb["trie_node"]
        kwargs = build_tree_attn_kwargs(trie, padded, input_ids.device)
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False, **kwargs).logits
        per_seq = _gather_packed_tree_logprobs(logits.squeeze(0), trie, mb["input_ids"], temperature=temperature)
        del logits
        tree_rows = {}
        for seq_id, logprobs in per_seq.items():  # logprobs[j]: log P(token j + 1 | tokens 0..j)
            start = len(prompts[seq_id]) - 1
            part = logprobs[start: start + lengths[seq_id]].float()
            tree_rows[seq_id] = torch.nn.functional.pad(part, (0, width - len(part)))
        if training:  # AReaL's engine: each micro-batch's backward before the next one's forward
            (torch.stack(list(tree_rows.values())) * response_mask[list(tree_rows)]).sum().backward()
            tree_rows = {i: row.detach() for i, row in tree_rows.items()}
        rows.update(tree_rows)
    out = torch.stack([rows[i] for i in range(len(prompts))])
    if training:  # the gradients are in place; the caller's backward of this leaf adds nothing
        out.requires_grad_(True)
    return out * response_mask, None
