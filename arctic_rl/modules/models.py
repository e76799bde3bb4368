"""Building the policy from a path or a config, and reading response log-probs from it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from arctic_rl.causal_lm import build_causal_lm, causal_lm_config  # noqa: F401  (moved to a leaf module; re-exported)
from arctic_rl.router_replay import RoutedTokens, replaying

if TYPE_CHECKING:
    from arctic_rl.zorro.head_spec import HeadTransform


def response_logprobs(
    model: torch.nn.Module,
    prompt_token_ids: list[list[int]],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    pad_token_id: int,
    vocab_chunk_rows: int = 4096,
    routed: RoutedTokens | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of each response token under ``model``, per sequence (naive layout),
    at ``temperature`` over the logits the model itself returns (its head transform, ``head_spec.py``).

    Each row is ``prompt_i + response_i``, right-padded; ``response_mask`` may have holes (tokens that are
    inputs but not targets, e.g. a multi-turn rollout's observations: their log-probs are zero). Logits
    are computed only at the positions that predict response tokens (the prompt's last token and the
    response's tokens but the last), ``vocab_chunk_rows`` hidden states at a time, so memory is not
    tokens x vocab at once. ``routed``: router replay (``router_replay.py``), each token routed to its recorded experts.

    Returns:
        ``logprobs [N, R]`` and ``entropy [N, R]`` (or None), zero where ``response_mask`` is 0.
    """
    n, r = response_ids.shape
    device = response_ids.device
    prompt_lens = torch.tensor([len(p) for p in prompt_token_ids], device=device)
    # a response's extent: one past its last masked-in token (holes, e.g. observation tokens, are inputs too)
    extent = torch.where(response_mask != 0, torch.arange(1, r + 1, device=device), 0)
    resp_lens = extent.amax(-1) if r else response_mask.sum(-1).long()
    total = int((prompt_lens + r).max())
    input_ids = torch.full((n, total), pad_token_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros((n, total), dtype=torch.long, device=device)
    for i, prompt in enumerate(prompt_token_ids):
        p, length = len(prompt), int(resp_lens[i])
        input_ids[i, :p] = torch.tensor(prompt, device=device)
        input_ids[i, p : p + r] = response_ids[i]
        attention_mask[i, : p + length] = 1
    from arctic_rl.zorro.head_spec import head_transform

    transform = head_transform(model)  # the model's own logit scaling / soft-cap
    with replaying(None if routed is None else routed.plan(routed.naive_addresses(total))):
        hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    # hidden state at position p-1+t predicts response token t
    positions = (prompt_lens[:, None] - 1 + torch.arange(r, device=device)[None]).clamp(max=total - 1)
    hidden = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))  # [N, R, H]
    logprobs, entropy = token_logprobs_from_hidden(
        hidden.reshape(n * r, -1), response_ids.reshape(-1), model.get_output_embeddings(), temperature, with_entropy,
        vocab_chunk_rows, transform,
    )
    logprobs = logprobs.view(n, r) * response_mask
    return logprobs, None if entropy is None else entropy.view(n, r) * response_mask


def token_logprobs_from_hidden(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lm_head: torch.nn.Module,
    temperature: float,
    with_entropy: bool,
    chunk_rows: int,
    transform: HeadTransform | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(transform(lm_head(h)) / T)[target]`` (and the entropy) for each row of
    ``hidden [M, H]``, computing logits ``chunk_rows`` rows at a time and keeping them for backward
    (no recompute). ``transform``: the model's head post-processing (None: none)."""
    from arctic_rl.zorro.head_spec import IDENTITY
    from arctic_rl.zorro.logprobs import chunked_token_logprobs

    return chunked_token_logprobs(
        hidden, targets, lm_head, temperature, with_entropy, chunk_rows, recompute=False, transform=transform or IDENTITY
    )


def named_parameters_with_tied_head(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters()``, with a tied output embedding also listed under its own name, right
    after the embedding (vLLM's in-place reload does not re-tie ``lm_head`` to ``embed_tokens``)."""
    named = list(model.named_parameters())
    if model.config.get_text_config().tie_word_embeddings:
        head = model.get_output_embeddings()
        name = next(n for n, m in model.named_modules() if m is head)
        tied_to = next(i for i, (_, p) in enumerate(named) if p is head.weight)
        named.insert(tied_to + 1, (f"{name}.weight", head.weight))  # same bucket: gathered once
    return named
