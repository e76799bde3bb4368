"""Router replay (R3, ``corrections.router_replay``) on a toy MoE on CPU: how often the trainer's top-k differs from the
sampler's, and the sampled tokens' log-prob gap between trainer and sampler, without and with replay.

A tiny random Qwen3-MoE (8 experts, top-2, 2 layers, hidden 64, the toy tokenizer) is the trainer's model (float32).
The sampler is arctic-rl's transformers engine over a copy that differs from it in one of these ways (``--cases``):

- ``bf16``: the same weights, sampled in bfloat16 (the usual source of mismatch: the engine's precision or kernels);
- ``router<eps>``: float32, router weights perturbed by ``eps`` of their mean size (a trainer one step away).

It samples ``--prompts`` toy prompts x ``--group`` samples of ``--tokens`` tokens with ``return_routed_experts``. Then
the trainer's ZoRRo log-probs of the sampled tokens (and naive, ``--naive``) are computed without and with replay:

- ``mismatch``: share of replayed (token, MoE layer) choices whose trainer top-k set differs from the sampler's
  (``router/mismatch``); ``mismatch_tokens``: share of tokens with a difference at any layer;
- ``gap_mean`` / ``gap_max``: mean and largest ``|log pi_trainer - log pi_sampler|`` over the sampled tokens;
- ``forward_s``: the trainer's no-grad ZoRRo forward, median of ``--repeats`` (the cost of replay's hooks).

    python benchmarks/router_replay.py                     # ~20 s on 2 CPU cores
    python benchmarks/router_replay.py --out rr.json --cases bf16 router0.01 router0.05
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time

import torch

from arctic_rl.rollout.engines.base import SamplingConfig
from arctic_rl.rollout.engines.transformers.engine import TransformersEngine
from arctic_rl.rollout.generation import routing_of
from arctic_rl.router_replay import RoutedTokens, install_router_hooks
from arctic_rl.serve.batch import TrainBatch
from arctic_rl.tasks.toy import build_tokenizer, make_rows
from arctic_rl.zorro import zorro_response_logprobs
from arctic_rl.modules.models import response_logprobs

MOE = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
           num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
           max_position_embeddings=256, tie_word_embeddings=True, norm_topk_prob=True)


def build_trainer_model(tokenizer) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**MOE, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def sampler_copy(model: torch.nn.Module, case: str) -> tuple[torch.nn.Module, str]:
    """The sampler's model and its engine dtype for ``case``."""
    other = copy.deepcopy(model)
    if case == "bf16":
        return other, "bfloat16"
    eps = float(case.removeprefix("router"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(eps * p.abs().mean() * torch.randn(p.shape, generator=g))
    return other, "float32"


def sample(model, dtype: str, tokenizer, args) -> tuple:
    """The engine's rollout: prompt ids (one per sample), responses, mask, sampler log-probs, routing."""
    with tempfile.TemporaryDirectory() as root:
        model.save_pretrained(root)
        tokenizer.save_pretrained(root)
        engine = TransformersEngine(root, dtype=dtype)
        try:
            prompts = [tokenizer(row["prompt"])["input_ids"] for row in make_rows(args.prompts, seed=0)]
            out = engine.generate(prompts, SamplingConfig(n=args.group, max_tokens=args.tokens, seed=1, return_routed_experts=True))
        finally:
            engine.shutdown()
    flat = [c for per_prompt in out for c in per_prompt]
    prompt_ids = [p for p in prompts for _ in range(args.group)]
    batch = TrainBatch.build(prompt_ids, [c.token_ids for c in flat], sampler_logprobs=[c.logprobs for c in flat])
    ids = batch.response_ids.masked_fill(batch.response_mask == 0, tokenizer.pad_token_id)
    return prompt_ids, ids, batch.response_mask, batch.sampler_logprobs, routing_of(prompt_ids, flat, ids.shape[1])


@torch.no_grad()
def measure(model, rollout, pad_id: int, zorro: bool, replay: bool, repeats: int) -> dict:
    prompt_ids, ids, mask, sampler, routing = rollout
    run = zorro_response_logprobs if zorro else response_logprobs
    times, routed = [], None
    for _ in range(repeats):
        routed = RoutedTokens(routing) if replay else None
        started = time.perf_counter()
        logprobs = run(model, prompt_ids, ids, mask, 1.0, False, pad_id, routed=routed)[0]
        times.append(time.perf_counter() - started)
    gap = (logprobs - sampler).abs()[mask > 0]
    result = {"gap_mean": float(gap.mean()), "gap_max": float(gap.max()), "forward_s": statistics.median(times)}
    if routed is not None:
        result.update({k.removeprefix("router/"): v for k, v in routed.metrics().items()})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["bf16", "router0.01", "router0.05"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--naive", action="store_true", help="also the naive (per-sequence) forward")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    trainer = build_trainer_model(tokenizer)
    install_router_hooks(trainer)
    results = []
    for case in args.cases:
        sampler_model, dtype = sampler_copy(trainer, case)
        rollout = sample(sampler_model, dtype, tokenizer, args)
        for zorro in (True, False) if args.naive else (True,):
            free = measure(trainer, rollout, tokenizer.pad_token_id, zorro, False, args.repeats)
            replayed = measure(trainer, rollout, tokenizer.pad_token_id, zorro, True, args.repeats)
            row = {"case": case, "path": "zorro" if zorro else "naive", "tokens": int(rollout[2].sum()),
                   "mismatch": replayed["mismatch"], "mismatch_tokens": replayed["mismatch_tokens"],
                   "gap_mean_without": free["gap_mean"], "gap_max_without": free["gap_max"],
                   "gap_mean_with": replayed["gap_mean"], "gap_max_with": replayed["gap_max"],
                   "forward_s_without": free["forward_s"], "forward_s_with": replayed["forward_s"]}
            results.append(row)
            print(json.dumps(row))
    print("\n| sampler | path | tokens | mismatch (token-layer / token) | gap mean without -> with | gap max without -> with | forward s without / with |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['case']} | {r['path']} | {r['tokens']} | {r['mismatch']:.3f} / {r['mismatch_tokens']:.3f} | "
              f"{r['gap_mean_without']:.2e} -> {r['gap_mean_with']:.2e} | {r['gap_max_without']:.2e} -> {r['gap_max_with']:.2e} | "
              f"{r['forward_s_without']:.4f} / {r['forward_s_with']:.4f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
