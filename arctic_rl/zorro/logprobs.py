"""``zorro_response_logprobs``: the drop-in, deduplicated twin of
``arctic_rl.modules.models.response_logprobs`` (same arguments, same results and gradients).

One forward of the packed row (``packing.py``) through the decoder with the ZoRRo mask, then the
output head only at the M positions that predict response tokens, ``chunk_rows`` rows at a time.
Each head chunk is activation-checkpointed: its ``[rows, vocab]`` fp32 logits are recomputed in
backward instead of being kept, so memory does not grow with tokens x vocabulary.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from arctic_rl.zorro.cascade import CascadeMask, cascade_plan
from arctic_rl.zorro.attention import counting_zorro_calls, install_zorro_attention
from arctic_rl.zorro.masks import dense_zorro_mask, zorro_block_mask
from arctic_rl.zorro.packing import PackedLayout, pack_shared_prompts, response_lengths

ATTENTION_BACKENDS = ("auto", "flex", "sdpa", "flash_varlen")
FLEX_BLOCK_SIZE = 128


def resolve_backend(attention_backend: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on CUDA, ``sdpa`` (dense boolean mask, the reference) elsewhere."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
    if attention_backend == "flash_varlen" and device.type != "cuda":
        raise ValueError(f"attention_backend='flash_varlen' runs torch's FlashAttention-2 kernels and needs CUDA, got {device}")
    if attention_backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return attention_backend


def zorro_response_logprobs(
    model: torch.nn.Module,
    prompt_token_ids: list[list[int]],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    pad_token_id: int,
    attention_backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of each response token under ``model``, computing each distinct
    prompt once per call.

    Args:
        model: a transformers causal LM whose attention goes through ``AttentionInterface``
            (switched to the ``"zorro"`` implementation on first use; see ``attention.py``).
        prompt_token_ids: N prompts, any lengths, no padding; identical prompts are shared
            wherever they are in the batch.
        response_ids: ``[N, R]`` right-padded responses.
        response_mask: ``[N, R]`` 1 on response tokens (a prefix of each row), 0 on padding.
        temperature: logits are divided by it before the softmax.
        with_entropy: also return the entropy of each predictive distribution.
        pad_token_id: token used to pad the packed row to the FlexAttention block size.
        attention_backend: ``auto`` (``flex`` on CUDA, ``sdpa`` elsewhere), ``flex`` (FlexAttention
            block mask, compiled), ``flash_varlen`` (cascade attention over torch's FlashAttention-2
            varlen kernels: no compile, bf16/fp16, CUDA) or ``sdpa`` (dense boolean mask, reference).

    Returns:
        ``logprobs [N, R]`` fp32 and ``entropy [N, R]`` (or None), zero where ``response_mask`` is 0.
    """
    backend = resolve_backend(attention_backend, response_ids.device)
    n, r = response_ids.shape
    layout = pack_shared_prompts(
        prompt_token_ids, response_ids, response_lengths(response_mask),
        pad_to_multiple=FLEX_BLOCK_SIZE if backend == "flex" else 1, pad_token_id=pad_token_id,
        prompts_first=backend == "flash_varlen",
    )
    zeros = torch.zeros(n * r, dtype=torch.float32, device=response_ids.device)
    if layout.target_ids.numel() == 0:
        return zeros.view(n, r), zeros.view(n, r).clone() if with_entropy else None
    hidden = packed_hidden_states(model, layout, backend)
    logprobs, entropy = chunked_token_logprobs(
        hidden[layout.predictor_index], layout.target_ids, model.get_output_embeddings(), temperature, with_entropy
    )
    logprobs = zeros.index_copy(0, layout.output_index, logprobs).view(n, r)
    if entropy is None:
        return logprobs, None
    return logprobs, zeros.index_copy(0, layout.output_index, entropy).view(n, r)


def packed_hidden_states(model: torch.nn.Module, layout: PackedLayout, backend: str) -> torch.Tensor:
    """Final hidden states ``[T, H]`` of the packed row, checking every attention layer saw the mask."""
    expected = install_zorro_attention(model)
    if backend == "flex":
        mask = zorro_block_mask(layout.segment_ids, layout.parent_ids, FLEX_BLOCK_SIZE)
    elif backend == "flash_varlen":
        dtype = model.get_input_embeddings().weight.dtype
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention_backend='flash_varlen' needs bf16 or fp16 weights (FlashAttention-2), got {dtype}")
        mask = CascadeMask.of(cascade_plan(layout.segment_ids, layout.parent_ids), layout.input_ids.device)
    else:
        mask = dense_zorro_mask(layout.segment_ids, layout.parent_ids)
    with counting_zorro_calls() as calls:
        out = model.get_decoder()(
            input_ids=layout.input_ids[None], position_ids=layout.position_ids[None], attention_mask=mask, use_cache=False
        )
    if calls[0] != expected:
        raise RuntimeError(
            f"model type '{model.config.model_type}': {calls[0]} of {expected} attention layers went through the ZoRRo "
            "attention function; the others bypass AttentionInterface and would ignore the packed mask"
        )
    return out.last_hidden_state[0]


def chunked_token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lm_head: torch.nn.Module,
    temperature: float,
    with_entropy: bool,
    chunk_rows: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(lm_head(h) / T)[target]`` (and entropy) for each row of ``hidden [M, H]``;
    each chunk is recomputed in backward rather than keeping its logits."""
    head = functools.partial(_head_chunk, lm_head, temperature, with_entropy)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters()))
    logps, ents = [], []
    for s in range(0, hidden.shape[0], chunk_rows):
        h, t = hidden[s : s + chunk_rows], targets[s : s + chunk_rows]
        logp, ent = checkpoint(head, h, t, use_reentrant=False) if recompute else head(h, t)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents) if with_entropy else None


def _head_chunk(lm_head, temperature, with_entropy, hidden, targets):
    logits = lm_head(hidden).float() / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    if not with_entropy:
        return logp, None
    return logp, logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
