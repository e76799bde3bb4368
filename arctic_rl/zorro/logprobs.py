"""``zorro_response_logprobs``: the drop-in, deduplicated twin of
``arctic_rl.modules.models.response_logprobs`` (same arguments, same results and gradients).

One forward of the packed row (``packing.py``) through the decoder with the ZoRRo mask, then the
output head only at the M positions that predict response tokens, ``chunk_rows`` rows at a time.
Each head chunk is activation-checkpointed: its ``[rows, vocab]`` fp32 logits are recomputed in
backward instead of being kept, so memory does not grow with tokens x vocabulary.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from arctic_rl.router_replay import RoutedTokens, replaying

from arctic_rl.zorro.attention import counting_zorro_calls, install_zorro_attention
from arctic_rl.zorro.cascade import cascade_plan
from arctic_rl.zorro.features import ZorroUnsupportedModel
from arctic_rl.zorro.head_spec import IDENTITY, HeadTransform, chain_to_head_output_, head_transform, tempered_logits
from arctic_rl.zorro.linear_attention import SEGMENTS_KWARG, LinearSegments
from arctic_rl.zorro.packed_mask import FLEX_BLOCK_SIZE, PackedMask
from arctic_rl.zorro.packing import PackedLayout, pack_shared_prompts, response_lengths
from arctic_rl.zorro.prefix_tree import pack_prefix_tree, response_extents
from arctic_rl.zorro.sequence_parallel import SequenceParallel, SequenceParallelError

ATTENTION_BACKENDS = ("auto", "flex", "sdpa", "flash_varlen", "cudnn")
CASCADE_BACKENDS = {"flash_varlen": "flash", "cudnn": "cudnn"}  # backend -> cascade kernel
DEDUP_MODES = ("group", "tree")  # pack_shared_prompts | pack_prefix_tree


def check_dedup(dedup: str, attention_backend: str) -> None:
    """``dedup`` is one of ``DEDUP_MODES`` and, for ``tree``, ``attention_backend`` can run a tree row."""
    if dedup not in DEDUP_MODES:
        raise ValueError(f"ZoRRo dedup must be one of {DEDUP_MODES}, got {dedup!r}")
    if dedup == "tree" and attention_backend in CASCADE_BACKENDS:
        raise ValueError(f"ZoRRo dedup 'tree' (prefix-tree rows) runs on the flex or sdpa attention backends; "
                         f"{attention_backend!r} is cascade attention, which expresses one shared prompt per group: "
                         "use attention_backend flex (GPU) or sdpa, or dedup 'group'")


def resolve_backend(attention_backend: str, device: torch.device) -> str:
    """``auto`` -> ``flex`` on CUDA, ``sdpa`` (dense boolean mask, the reference) elsewhere. Sequence parallelism
    runs every backend as one rank does: after the exchange each rank holds the whole row for its heads."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
    if attention_backend in CASCADE_BACKENDS and device.type != "cuda":
        raise ValueError(f"attention_backend={attention_backend!r} runs fused CUDA attention kernels and needs CUDA, got {device}")
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
    dedup: str = "group",
    routed: RoutedTokens | None = None,
    sequence_parallel: SequenceParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of each response token under ``model``, computing each distinct
    prompt once per call (``dedup="group"``), or each distinct prefix once (``dedup="tree"``).

    Args:
        model: a transformers causal LM whose attention goes through ``AttentionInterface``
            (switched to the ``"zorro"`` implementation on first use; see ``attention.py``).
        prompt_token_ids: N prompts, any lengths, no padding; identical prompts are shared
            wherever they are in the batch.
        response_ids: ``[N, R]`` right-padded responses.
        response_mask: ``[N, R]`` 1 on response tokens (a prefix of each row), 0 on padding.
        temperature: the model's logits (its own head transform included, ``head_spec.py``) are
            divided by it before the softmax.
        with_entropy: also return the entropy of each predictive distribution.
        pad_token_id: token used to pad the packed row to the FlexAttention block size.
        attention_backend: ``auto`` (``flex`` on CUDA, ``sdpa`` elsewhere), ``flex`` (FlexAttention
            block mask, compiled), ``cudnn`` (cascade attention over cuDNN's fused kernels in dense
            batches: no compile, bf16/fp16, CUDA), ``flash_varlen`` (cascade attention over torch's
            FlashAttention-2 varlen kernels) or ``sdpa`` (dense boolean mask, reference).
        dedup: ``group`` (``pack_shared_prompts``: identical prompts once; ``response_mask`` a prefix
            of ones) or ``tree`` (``pack_prefix_tree``: every shared prefix of prompt + response once,
            at any depth; ``response_mask`` may have holes, e.g. observation tokens, which are inputs
            with zero log-prob; flex or sdpa only, not hybrid linear-attention models).
        routed: router replay (``router_replay.py``): every packed token routed to the experts recorded for it (a
            shared prompt's tokens: those recorded with its first sample). ``dedup="group"`` only.
        sequence_parallel: the ranks that share this batch's packed row (``sequence_parallel.py``): every one of
            them passes the same samples, runs the decoder on its ``T/N`` rows, and gets every result. None: one rank.
            Not with ``routed`` (the replay plan covers the whole row; not split yet).

    Returns:
        ``logprobs [N, R]`` fp32 and ``entropy [N, R]`` (or None), zero where ``response_mask`` is 0.
    """
    sp = sequence_parallel
    backend = resolve_backend(attention_backend, response_ids.device)
    check_dedup(dedup, backend)
    n, r = response_ids.shape
    pad_to_multiple = FLEX_BLOCK_SIZE if backend == "flex" else 1
    if sp is not None:
        sp.check_model(model)
        pad_to_multiple = sp.row_multiple(pad_to_multiple)
    if dedup == "tree":
        layout = pack_prefix_tree(prompt_token_ids, response_ids, response_extents(response_mask), pad_to_multiple,
                                  pad_token_id, target_mask=response_mask)
    else:
        pack = functools.partial(pack_shared_prompts, lengths=response_lengths(response_mask), pad_to_multiple=pad_to_multiple,
                                 prompts_first=backend in CASCADE_BACKENDS)
        layout = pack(prompt_token_ids, response_ids, pad_token_id=pad_token_id)
    plan = None
    if routed is not None and sp is not None:
        raise SequenceParallelError("router replay's plan covers the whole packed row; it is not split over "
                                    "sequence-parallel ranks yet: use one of the two")
    if routed is not None:
        if dedup != "group":
            raise ValueError("router replay maps recorded tokens into the shared-prompt layout: dedup must be 'group'")
        plan = routed.plan(packed_addresses(pack, prompt_token_ids, response_ids, routed.routing.shape[1]))
    if layout.target_ids.numel() == 0:
        dtype = torch.promote_types(model.get_input_embeddings().weight.dtype, torch.float32)
        zeros = torch.zeros(n, r, dtype=dtype, device=response_ids.device)
        return zeros, zeros.clone() if with_entropy else None
    with replaying(plan):
        hidden = packed_hidden_states(model, layout, backend, sp)  # checks the model first (ZorroUnsupportedModel)
    transform = head_transform(model)
    index, targets, owner = layout.predictor_index, layout.target_ids, None
    if sp is not None:  # the tokens predicted from my rows only; every rank's values are gathered below
        rows = sp.local_rows(layout.num_tokens)
        owner = torch.div(index, rows.stop - rows.start, rounding_mode="floor")
        mine = owner == sp.rank
        index, targets = index[mine] - rows.start, targets[mine]
    logprobs, entropy = chunked_token_logprobs(
        gather_rows(hidden, index), targets, model.get_output_embeddings(), temperature, with_entropy, transform=transform,
    )
    if sp is not None:
        values = sp.gather_token_values(torch.stack([logprobs] + ([] if entropy is None else [entropy]), -1), owner)
        logprobs, entropy = values[:, 0], None if entropy is None else values[:, 1]
    zeros = logprobs.new_zeros(n * r)  # fp32, fp64 for a float64 model
    logprobs = zeros.index_copy(0, layout.output_index, logprobs).view(n, r)
    if entropy is None:
        return logprobs, None
    return logprobs, zeros.index_copy(0, layout.output_index, entropy).view(n, r)


def packed_addresses(pack: Callable[..., PackedLayout], prompt_token_ids: list[list[int]], response_ids: torch.Tensor,
                     width: int) -> torch.Tensor:
    """Where each token of the packed row comes from: ``pack`` (``pack_shared_prompts`` with the call's other arguments)
    run over addresses instead of token ids. Token ``j`` of row ``i`` of the naive layout (prompt, then response) is
    ``i * width + j``; every copy of one prompt gets the addresses of its first row, so equal prompts are still
    shared exactly where the token ids share them; padding is -1."""
    first: dict[tuple[int, ...], int] = {}
    prompts = []
    for i, ids in enumerate(prompt_token_ids):
        owner = first.setdefault(tuple(ids), i)
        prompts.append([owner * width + j for j in range(len(ids))])
    n, r = response_ids.shape
    starts = torch.tensor([i * width + len(ids) for i, ids in enumerate(prompt_token_ids)], dtype=torch.long).view(n, 1)
    responses = starts + torch.arange(r, dtype=torch.long)[None]
    return pack(prompts, responses, pad_token_id=-1).input_ids


def gather_rows(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``hidden[index]`` with a backward that sums repeated rows in a fixed order. The G responses' first
    tokens all read their prompt's last state, so ``index`` repeats rows. On CPU advanced indexing's
    backward (``index_put_`` with accumulate) adds repeats with atomics in no fixed order, which made two
    identical runs differ in the last bits of the gradient; ``index_select``'s backward (``index_add_``)
    adds them in index order. On CUDA it is the reverse: ``index_add_`` uses atomics and ``index_put_``
    with accumulate sorts."""
    return hidden.index_select(0, index) if hidden.device.type == "cpu" else hidden[index]


def packed_hidden_states(model: torch.nn.Module, layout: PackedLayout, backend: str,
                         sequence_parallel: SequenceParallel | None = None) -> torch.Tensor:
    """Final hidden states ``[T, H]`` of the packed row (``[T/N, H]``, this rank's rows, under
    ``sequence_parallel``), checking every attention layer saw the mask (and every linear-attention
    layer the segments: ``linear_attention.py``)."""
    features = install_zorro_attention(model)
    expected, plan = sum(not f.linear for f in features), None
    if sequence_parallel is not None and expected < len(features):
        raise SequenceParallelError(f"model type '{model.config.model_type}' has linear-attention layers, whose "
                                    "recurrent state runs along the whole sequence: sequence parallelism does not split them")
    if layout.ancestors is not None and expected < len(features):
        raise ZorroUnsupportedModel(
            f"model type '{model.config.model_type}' has linear-attention layers, whose per-segment states ZoRRo "
            "threads through one shared prompt only: use dedup 'group' (model.compute.zorro_dedup: group) for it"
        )
    linear = LinearSegments.of(layout) if expected < len(features) else None
    if backend in CASCADE_BACKENDS:
        dtype = model.get_input_embeddings().weight.dtype
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention_backend={backend!r} needs bf16 or fp16 weights (fused kernels), got {dtype}")
        plan = cascade_plan(layout.segment_ids, layout.parent_ids)
    mask = PackedMask.of(layout, CASCADE_BACKENDS.get(backend, backend), features, model.config.model_type, plan,
                         sequence_parallel)
    rows = slice(None) if sequence_parallel is None else sequence_parallel.local_rows(layout.num_tokens)
    with counting_zorro_calls() as calls:
        out = model.get_decoder()(
            input_ids=layout.input_ids[rows][None], position_ids=layout.position_ids[rows][None], attention_mask=mask,
            use_cache=False,
            **({} if linear is None else {SEGMENTS_KWARG: linear}),
        )
    if calls[0] != expected:
        raise RuntimeError(
            f"model type '{model.config.model_type}': {calls[0]} of {expected} attention layers received the packed ZoRRo "
            "mask; the others bypass AttentionInterface or rebuild the mask in their forward, and would ignore it"
        )
    if linear is not None:
        linear.check_calls(len(features) - expected, model.config.model_type)
    return out.last_hidden_state[0]


def chunked_token_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lm_head: torch.nn.Module,
    temperature: float,
    with_entropy: bool,
    chunk_rows: int = 4096,
    recompute: bool = True,
    transform: HeadTransform = IDENTITY,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(transform(lm_head(h)) / T)[target]`` (and entropy) for each row of ``hidden [M, H]``,
    ``chunk_rows`` rows at a time. ``recompute``: under autograd, each chunk's logits are recomputed
    in backward rather than kept (memory does not grow with tokens x vocabulary). ``transform``: the
    model's own post-processing of its head's output (``head_spec.head_transform(model)``)."""
    head = functools.partial(_head_chunk, lm_head, temperature, with_entropy, transform)
    needs_grad = hidden.requires_grad or any(p.requires_grad for p in lm_head.parameters())
    recompute = recompute and torch.is_grad_enabled() and needs_grad
    logps, ents = [], []
    # at least one (possibly empty) chunk: a sequence-parallel rank whose rows predict no target still runs the head,
    # so its values join the gather and its backward reaches the exchanges the other ranks wait on
    for s in range(0, max(hidden.shape[0], 1), chunk_rows):
        h, t = hidden[s : s + chunk_rows], targets[s : s + chunk_rows]
        logp, ent = checkpoint(head, h, t, use_reentrant=False) if recompute else head(h, t)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), torch.cat(ents) if with_entropy else None


def _head_chunk(lm_head, temperature, with_entropy, transform, hidden, targets):
    return token_logprobs_from_logits(lm_head(hidden), targets, temperature, with_entropy, transform=transform)


def token_logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    fused: bool | None = None,
    transform: HeadTransform = IDENTITY,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(transform(logits) / T)[target]`` and the entropy, in fp32 (fp64 for fp64
    logits), for each row of head outputs ``logits [M, V]``. Gradients are exact and in closed form
    (``_LogprobFromLogits``).

    ``fused``: run the Triton kernels of ``head_kernels.py`` (one read of the logits per pass);
    default: on CUDA when Triton is importable, unless ``ARCTIC_RL_FUSED_HEAD=0``."""
    if fused is None:
        fused = _fused_head_available(logits)
    d, c = transform.kernel_params(float(temperature))
    logp, entropy = _LogprobFromLogits.apply(logits, targets, d, c, with_entropy, fused)
    return logp, entropy if with_entropy else None


FUSED_HEAD_ENV = "ARCTIC_RL_FUSED_HEAD"


def _fused_head_available(logits: torch.Tensor) -> bool:
    if not logits.is_cuda or logits.dim() != 2 or logits.stride(-1) != 1 or logits.dtype == torch.float64:
        return False
    return os.environ.get(FUSED_HEAD_ENV, "1") != "0" and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class _LogprobFromLogits(torch.autograd.Function):
    """One autograd node for the head's vocabulary math, with the backward written out:
    ``dz = g_lp (onehot - p) - g_ent p (log p + H)``, ``dlogits = dz * dz/du`` for the tempered
    logits ``z = c tanh(u / d)`` or ``u / d`` of head outputs ``u`` (``head_spec.py``).

    Saves the logits as given (bf16 from a bf16 head) and ``log Z``, not the fp32 copy autograd
    would keep. In torch it skips the passes autograd spends on the gather's scatter, the sum of two
    gradients and the division when ``T == 1``; the fused Triton kernels read the logits once per
    pass. Same values and gradients as the plain formula (``tests/zorro/test_logprobs.py``)."""

    @staticmethod
    def forward(ctx, logits, targets, d, c, with_entropy, fused):
        targets = targets.contiguous()
        if fused:
            from arctic_rl.zorro.head_kernels import fused_forward

            logp, logz, entropy = fused_forward(logits, targets, d, c, with_entropy)
        else:
            z = tempered_logits(logits, d, c)
            logz = torch.logsumexp(z, dim=-1)
            logp = z.gather(-1, targets[:, None]).squeeze(-1) - logz
            if with_entropy:
                log_probs = z.sub_(logz[:, None])
                entropy = -(log_probs.exp() * log_probs).sum(-1)
            else:
                entropy = logz.new_zeros(0)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, targets, logz, entropy)
        ctx.d, ctx.c, ctx.with_entropy, ctx.fused = d, c, with_entropy, fused
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, logz, entropy = ctx.saved_tensors
        grad_logp = torch.zeros_like(logz) if grad_logp is None else grad_logp.contiguous()
        grad_entropy = grad_entropy if ctx.with_entropy else None
        if ctx.fused:
            from arctic_rl.zorro.head_kernels import fused_backward

            grad = fused_backward(logits, targets, logz, entropy, grad_logp, grad_entropy, ctx.d, ctx.c)
            return grad, None, None, None, None, None
        log_probs = tempered_logits(logits, ctx.d, ctx.c).sub_(logz[:, None])
        if grad_entropy is not None:
            probs = log_probs.exp()
            factor = log_probs.add_(entropy[:, None]).mul_(-grad_entropy[:, None]).sub_(grad_logp[:, None])
            grad = probs.mul_(factor)
        else:
            grad = log_probs.exp_().mul_(-grad_logp[:, None])
        grad.scatter_add_(-1, targets[:, None], grad_logp[:, None])
        grad = chain_to_head_output_(grad, logits, ctx.d, ctx.c)
        return grad.to(logits.dtype), None, None, None, None, None
