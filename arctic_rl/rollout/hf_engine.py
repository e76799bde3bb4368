"""A rollout engine on transformers' ``generate``: the fallback where vLLM is not installed (and the
engine used on the GPU machine here, which has no vLLM). Slower than vLLM, same interface."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from arctic_rl.rollout.engine import Completion, SamplingConfig
from arctic_rl.rollout.seeds import request_seeds


class TransformersEngine:
    """Holds its own copy of the model and samples with ``model.generate``.

    Args:
        model_path: a ``save_pretrained`` directory (model and tokenizer).
        dtype: torch dtype name for the engine's copy (``float32`` on CPU).
        device: where the engine's model lives (``cpu``, ``cuda``, ``cuda:1``).
    """

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """Prompts of equal length are sampled together, ``n`` rows each, in one batch (no padding, so every
        row computes exactly what it would alone); each sample draws from its own seeded stream."""
        seeds = request_seeds(sampling.seed, sampling.prompt_seeds, len(prompt_token_ids), sampling.n)
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(prompt_token_ids):
            by_length.setdefault(len(ids), []).append(i)
        out: list[list[Completion]] = [[] for _ in prompt_token_ids]
        for same_length in by_length.values():
            rows = [prompt_token_ids[i] for i in same_length for _ in range(sampling.n)]
            generators = None if seeds is None else [self._generator(s) for i in same_length for s in seeds[i]]
            completions = self._generate_rows(rows, sampling, generators)
            for k, i in enumerate(same_length):
                out[i] = completions[k * sampling.n : (k + 1) * sampling.n]
        return out

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _generate_rows(self, rows: list[list[int]], sampling: SamplingConfig, generators: list[torch.Generator] | None) -> list[Completion]:
        """Sample one continuation of each row (all of one length), token by token with a KV cache; row
        ``k`` draws from ``generators[k]`` (its own stream) when given, else from the process's random state."""
        input_ids = torch.tensor(rows, device=self.device)
        out = self.model(input_ids=input_ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        tokens, logps = [], []
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        for _ in range(sampling.max_tokens):
            logprobs = torch.log_softmax(logits.float() / max(sampling.temperature, 1e-6), dim=-1)
            probs = _top_p_filter(logprobs.exp(), sampling.top_p)
            nxt = _sample(probs, generators)
            tokens.append(torch.where(done, self.pad_id, nxt))
            logps.append(logprobs.gather(-1, nxt[:, None]).squeeze(-1))
            done |= nxt == self.eos_id
            if done.all():
                break
            out = self.model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
        toks, lps = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()
        completions = []
        for row, lp in zip(toks, lps):
            length = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            reason = "stop" if self.eos_id in row[:length] else "length"
            completions.append(Completion(token_ids=row[:length], logprobs=lp[:length], finish_reason=reason))
        return completions

    @torch.no_grad()
    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        scores = []
        for ids in token_ids:
            x = torch.tensor([ids], device=self.device)
            logprobs = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), dim=-1)
            scores.append(logprobs.gather(-1, x[0, 1:, None]).squeeze(-1).tolist())
        return scores

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = self.model.state_dict(keep_vars=True)  # includes tied names such as lm_head.weight
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine model has no parameter {name!r}")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    def sleep(self) -> None:
        self.model.to("cpu")

    def wake_up(self) -> None:
        self.model.to(self.device)

    def shutdown(self) -> None:
        del self.model


def _sample(probs: torch.Tensor, generators: list[torch.Generator] | None) -> torch.Tensor:
    """One token per row of ``probs`` ``[n, V]``; row ``k`` from ``generators[k]`` when given."""
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row outside the smallest set with cumulative probability >= top_p."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p > top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)
