"""Sampling for the transformers engine, batched and still one random stream per sample.

Each row draws token ``t`` by inverse-CDF sampling with the uniform ``u[row, t]``. With seeds, row ``k``'s
uniforms are the first ``max_tokens`` draws of ``torch.Generator().manual_seed(seeds[k])``. So a sample
depends only on its own seed and the model's probabilities, never on which rows share its batch, and the
whole batch is sampled with a few tensor ops. Tokens of probability zero are never drawn: the search
finds the first cumulative probability strictly greater than ``u * total``.
"""

from __future__ import annotations

import torch


def uniform_table(row_seeds: list[int] | None, rows: int, max_tokens: int, device: torch.device) -> torch.Tensor:
    """``[rows, max_tokens]`` float64 uniforms in ``[0, 1)``: row ``k`` from its own seeded generator, or
    (``row_seeds`` None) from the process's random state."""
    if row_seeds is None:
        return torch.rand(rows, max_tokens, dtype=torch.float64).to(device)
    if len(row_seeds) != rows:
        raise ValueError(f"{len(row_seeds)} seeds for {rows} rows")
    table = torch.empty(rows, max_tokens, dtype=torch.float64)
    generator = torch.Generator()
    for k, seed in enumerate(row_seeds):
        table[k] = torch.rand(max_tokens, generator=generator.manual_seed(seed), dtype=torch.float64)
    return table.to(device)


def sample_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ``[rows, V]`` from ``softmax(logits / temperature)`` restricted to
    the top-``top_p`` nucleus, chosen by the row's uniform ``u`` ``[rows]``. Returns the tokens and their
    log-probabilities under the temperature-scaled distribution before the nucleus cut (what the trainer's
    ``sampler_logprobs`` compare with, as vLLM reports them). Shapes are static: safe inside a CUDA graph."""
    logprobs = torch.log_softmax(logits.float() / max(temperature, 1e-6), dim=-1)
    probs = logprobs.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > top_p, 0.0)
        picked = _inverse_cdf(sorted_p, u)
        tokens = order.gather(-1, picked[:, None]).squeeze(-1)
    else:
        tokens = _inverse_cdf(probs, u)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index ``i`` of each row with ``cdf[i-1] <= u * cdf[-1] < cdf[i]`` (the cumulative sum in float64)."""
    cdf = probs.double().cumsum(-1)
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
