"""Rollout throughput of arctic-rl's transformers engine on one GPU, against transformers' own ``generate`` on
the same weights in the same run. Qwen3-1.7B shape, random weights, bf16, prompts of 100-300 tokens, G=8.

Cases (rows x new tokens):
- uniform: every row runs to the cap (no stop token is ever sampled);
- heavy-tailed: 10% of rows run to the cap, the rest stop at an eighth of it (the stop is forced at those
  steps by a benchmark-only wrapper around the sampler: random weights never choose their lengths);
- the baseline: ``model.generate`` over all rows left-padded, dynamic cache, ``min_new_tokens`` = cap.

    python benchmarks/hf_engine_gpu.py --out hf_engine.json [--shapes 64x256,256x512] [--no-baseline] [--liger-off]

Also reports peak memory, the memory an engine gives back with ``sleep()``, and how far the sampler's
log-probs are from the model's own forward over the same tokens (bf16).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.recipe_gsm8k_gpu import QWEN3_1_7B, word_tokenizer  # noqa: E402

G = 8


def build_model_dir(out: Path) -> Path:
    from arctic_rl.modules.models import build_causal_lm

    torch.manual_seed(0)
    model = build_causal_lm(dict(QWEN3_1_7B), "bfloat16")
    model.save_pretrained(out)
    word_tokenizer(QWEN3_1_7B["vocab_size"], out)
    return out


def prompts_for(rows: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 50000) for _ in range(rng.randint(100, 300))] for _ in range(rows // G)]


def timed(fn):
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - started


def ours(engine, prompts, max_tokens, stop_at=None):
    """One decode of all rows; ``stop_at[row]`` (a length) forces that row's stop token there."""
    from arctic_rl.rollout.engines.transformers import decode as hf_decode
    from arctic_rl.rollout.engines.transformers.sampling import uniform_table

    rows = len(prompts) * G
    uniforms = uniform_table(list(range(rows)), rows, max_tokens, engine.device)
    eos = 0 if stop_at is not None else -1  # -1: never sampled, every row runs to the cap
    engine.decoder.eos_id = eos
    real = hf_decode.sample_tokens
    if stop_at is not None:
        for row, length in enumerate(stop_at):
            if length < max_tokens:
                uniforms[row, length - 1] = 2.0  # the sentinel the wrapper below turns into the stop token

        def forced(logits, u, temperature, top_p):  # benchmark-only: shapes the workload, not the sampler
            tokens, logprobs = real(logits, u.clamp(max=0.999), temperature, top_p)
            return torch.where(u >= 1.0, eos, tokens), logprobs

        hf_decode.sample_tokens = forced
    try:
        decoded, seconds = timed(lambda: engine.decoder.decode(prompts, G, max_tokens, uniforms, 1.0, 1.0))
    finally:
        hf_decode.sample_tokens = real
    tokens = decoded.tokens
    if stop_at is None:
        generated = rows * max_tokens
    else:
        generated = int(sum(min(s, max_tokens) for s in stop_at))
        lengths = [(row.index(eos) + 1 if eos in row else len(row)) for row in tokens.tolist()]
        assert lengths == [min(s, max_tokens) for s in stop_at], "forced lengths not honoured"
    return {"s": seconds, "tokens": generated, "tokens_per_s": generated / seconds, "decode_steps": decoded.steps,
            "graphs": decoded.graphs, "capture_s": decoded.capture_s}, decoded


def through_generate(engine, prompts, max_tokens):
    """The same work through the engine's public ``generate()`` (seeded per sample, completions built), with its
    host-side parts timed apart: the uniform table, the decode loop, and the completions (``tolist`` and cutting)."""
    from arctic_rl.rollout.engines.base import SamplingConfig
    from arctic_rl.rollout.engines.transformers import engine as engine_module

    parts = {"uniform_table_s": 0.0, "decode_s": 0.0, "completions_s": 0.0}

    def clocked(name, fn):
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            started = time.perf_counter()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            parts[name] += time.perf_counter() - started
            return out
        return wrapper

    eos = (engine.eos_id, engine.decoder.eos_id)
    engine.eos_id = engine.decoder.eos_id = -1  # never sampled: every row runs to the cap, as in ``ours``
    real = (engine_module.uniform_table, engine.decoder.decode, engine_module._completions)
    engine_module.uniform_table = clocked("uniform_table_s", real[0])
    engine.decoder.decode = clocked("decode_s", real[1])
    engine_module._completions = clocked("completions_s", real[2])
    try:
        sampling = SamplingConfig(n=G, max_tokens=max_tokens, temperature=1.0, top_p=1.0, seed=0)
        out, seconds = timed(lambda: engine.generate(prompts, sampling))
    finally:
        engine_module.uniform_table, engine_module._completions = real[0], real[2]
        del engine.decoder.decode
        engine.eos_id, engine.decoder.eos_id = eos
    tokens = sum(len(c.token_ids) for per_prompt in out for c in per_prompt)
    return {"s": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, **{k: round(v, 4) for k, v in parts.items()},
            "other_s": round(seconds - sum(parts.values()), 4)}


def baseline(model_dir, prompts, max_tokens, pad_id):
    """transformers ``generate`` on a stock copy of the model (its own modules, SDPA): all rows left-padded,
    dynamic cache, sampling, no early stop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    rows = [p for p in prompts for _ in range(G)]
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device="cuda")
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device="cuda")
    _, seconds = timed(lambda: model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=max_tokens,
                                              min_new_tokens=max_tokens, pad_token_id=pad_id, top_k=0, top_p=1.0))
    del model
    torch.cuda.empty_cache()
    return {"s": seconds, "tokens": len(rows) * max_tokens, "tokens_per_s": len(rows) * max_tokens / seconds}


def logprob_error(engine, prompts, decoded, max_tokens, rows=16):
    """Sampler log-probs against the model's own forward over prompt + sampled tokens (bf16, eager)."""
    diffs = []
    with torch.no_grad():
        for r in range(rows):
            prompt, sampled = prompts[r // G], decoded.tokens[r, :max_tokens].tolist()
            ids = torch.tensor([prompt + sampled], device="cuda")
            logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
            diffs.append((lp - decoded.logprobs[r, :max_tokens].to(lp.device)).abs())
    d = torch.cat(diffs)
    return {"mean_abs": d.mean().item(), "max_abs": d.max().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64x256,256x512")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--liger-off", action="store_true", help="also time an engine without Liger's kernels")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(Path(tmp))
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        engine = TransformersEngine(str(model_dir), dtype="bfloat16", device="cuda")
        loaded = torch.cuda.memory_allocated()
        plain = TransformersEngine(str(model_dir), dtype="bfloat16", device="cuda", liger=False) if args.liger_off else None
        for shape in args.shapes.split(","):
            rows, max_tokens = map(int, shape.split("x"))
            prompts = prompts_for(rows)
            case = {"shape": shape}
            torch.cuda.reset_peak_memory_stats()
            case["ours_first"], _ = ours(engine, prompts, max_tokens)  # includes capturing the CUDA graphs
            case["ours"], decoded = ours(engine, prompts, max_tokens)
            case["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            through_generate(engine, prompts, max_tokens)  # a first call of its own (the seeded table's shapes)
            case["generate"] = through_generate(engine, prompts, max_tokens)
            case["generate_over_decode"] = case["generate"]["tokens_per_s"] / case["ours"]["tokens_per_s"]
            case["logprob_vs_forward"] = logprob_error(engine, prompts, decoded, max_tokens)
            stop_at = [max_tokens if (r * 7919) % 10 == 0 else max_tokens // 8 for r in range(rows)]
            case["ours_heavy_tailed"], _ = ours(engine, prompts, max_tokens, stop_at)
            case["heavy_over_uniform"] = case["ours_heavy_tailed"]["tokens_per_s"] / case["ours"]["tokens_per_s"]
            engine.decoder.cuda_graphs = False
            case["ours_no_cuda_graphs"], _ = ours(engine, prompts, max_tokens)
            engine.decoder.cuda_graphs = True
            if plain is not None:
                case["ours_without_liger"], _ = ours(plain, prompts, max_tokens)
            if not args.no_baseline:
                case["transformers_generate"] = baseline(str(model_dir), prompts, max_tokens, engine.pad_id)
                case["speedup"] = case["ours"]["tokens_per_s"] / case["transformers_generate"]["tokens_per_s"]
            print(json.dumps(case), flush=True)
            result["cases"].append(case)
        if plain is not None:
            plain.shutdown()
        torch.cuda.synchronize()
        engine.sleep()
        asleep = torch.cuda.memory_allocated()
        engine.wake_up()
        result["memory_gib"] = {"before_engine": before / 2**30, "engine_loaded": loaded / 2**30, "asleep": asleep / 2**30,
                                "awake": torch.cuda.memory_allocated() / 2**30}
        engine.shutdown()
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
