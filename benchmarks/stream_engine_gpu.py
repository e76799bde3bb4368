"""The transformers engine's throughput on heavy-tailed response lengths when it is driven as the rollout stream drives
it, against whole-batch calls, on one GPU in one run: Qwen3-1.7B shape, random weights, bf16, G = 8, prompts of
100-300 tokens (as ``hf_engine_gpu.py``).

Workload: ``--samples`` samples (``--samples / 8`` prompts x 8), each with a forced length (random weights never choose
their own): heavy-tailed, 10% at the cap and the rest at an eighth of it, or uniform (all at the cap). The stop token
is forced at each sample's length by a benchmark-only wrapper around the sampler (``hf_engine_gpu.ours``'s).

- ``batches``: the synchronous loop's calls: ``--rows`` rows (whole groups) a call, each call decoding until its
  longest row stops, the next call after it;
- ``stream``: the stream's rounds (``rollout/stream``): ``--rows`` rows in flight, each round one engine call that
  extends every unfinished row by at most ``--budget`` tokens (each row's prompt and tokens so far prefilled again, as a
  paused sample's KV is recomputed), rows that finish replaced by the next groups before the next round (whole groups,
  over-provisioning keeping the batch full).

Reported: generated tokens per second of each, heavy-tailed and uniform, and each heavy-tailed figure's share of the
uniform whole-batch figure (what ``hf_engine_gpu.py`` measured at 0.40 for 256 x 512 and 0.17 for 64 x 256).

    python benchmarks/stream_engine_gpu.py --rows 256 --cap 512 --samples 2048 --budget 64 --out stream_engine.json
    python benchmarks/stream_engine_gpu.py --device cpu --model tiny --rows 16 --cap 32 --samples 64 --budget 8   # smoke
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
TINY = {**QWEN3_1_7B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 4096}


def build_model_dir(out: Path, shape: dict) -> Path:
    from arctic_rl.modules.models import build_causal_lm

    torch.manual_seed(0)
    build_causal_lm(dict(shape), "bfloat16").save_pretrained(out)
    word_tokenizer(shape["vocab_size"], out)
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_rows(engine, contexts: list[list[int]], n: int, max_tokens: int, remaining: list[int]) -> tuple[list[list[int]], float]:
    """One engine call: ``n`` rows of each context, at most ``max_tokens`` tokens; row ``r`` stops after ``remaining[r]``
    tokens when that is within the call. Returns each row's tokens (cut after its stop) and the call's seconds."""
    from arctic_rl.rollout.engines.transformers import decode as hf_decode
    from arctic_rl.rollout.engines.transformers.sampling import uniform_table

    rows, eos = len(contexts) * n, 0
    uniforms = uniform_table(list(range(rows)), rows, max_tokens, engine.device)
    for row, left in enumerate(remaining):
        if left <= max_tokens:
            uniforms[row, left - 1] = 2.0  # the sentinel ``forced`` turns into the stop token
    real = hf_decode.sample_tokens

    def forced(logits, u, temperature, top_p):  # benchmark-only: shapes the workload, not the sampler
        tokens, logprobs = real(logits, u.clamp(max=0.999), temperature, top_p)
        tokens = torch.where(tokens == eos, eos + 1, tokens)  # the stop only where forced
        return torch.where(u >= 1.0, eos, tokens), logprobs

    hf_decode.sample_tokens, engine.decoder.eos_id = forced, eos
    try:
        synchronize(engine.device)
        started = time.perf_counter()
        decoded = engine.decoder.decode(contexts, n, max_tokens, uniforms, 1.0, 1.0)
        synchronize(engine.device)
        seconds = time.perf_counter() - started
    finally:
        hf_decode.sample_tokens = real
    out = []
    for row in decoded.tokens[:, : decoded.steps].tolist():
        out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out, seconds


def run_batches(engine, prompts: list[list[int]], lengths: list[int], rows: int, cap: int) -> dict:
    """The synchronous loop: ``rows`` rows (``rows / G`` prompts) a call, each call until its longest row stops."""
    per_call, generated, seconds = rows // G, 0, 0.0
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start : start + per_call]
        want = lengths[start * G : (start + len(chunk)) * G]
        out, s = decode_rows(engine, chunk, G, cap, want)
        assert [len(t) for t in out] == want, "forced lengths not honoured"
        generated, seconds = generated + sum(want), seconds + s
    return {"tokens": generated, "s": round(seconds, 3), "tokens_per_s": round(generated / seconds), "calls": len(range(0, len(prompts), per_call))}


def run_stream(engine, prompts: list[list[int]], lengths: list[int], rows: int, budget: int) -> dict:
    """The stream's rounds: ``rows`` rows in flight, each round extends every row by at most ``budget`` tokens (its
    context prefilled again), finished groups replaced by the next ones before the next round."""
    queue = list(range(len(prompts)))  # prompts not started
    active: list[dict] = []  # one per row: prompt index, its tokens so far, its target length
    generated, seconds, rounds, prefilled = 0, 0.0, 0, 0
    while queue or active:
        while queue and len(active) + G <= rows:  # whole groups, as the stream admits them
            p = queue.pop(0)
            active += [{"prompt": p, "tokens": [], "length": lengths[p * G + k]} for k in range(G)]
        contexts = [prompts[a["prompt"]] + a["tokens"] for a in active]
        remaining = [a["length"] - len(a["tokens"]) for a in active]
        out, s = decode_rows(engine, contexts, 1, budget, remaining)
        rounds, seconds, prefilled = rounds + 1, seconds + s, prefilled + sum(map(len, contexts))
        for a, new in zip(active, out):
            a["tokens"] += new
            generated += len(new)
        assert all(len(a["tokens"]) <= a["length"] for a in active)
        active = [a for a in active if len(a["tokens"]) < a["length"]]
    return {"tokens": generated, "s": round(seconds, 3), "tokens_per_s": round(generated / seconds), "rounds": rounds,
            "prefilled_tokens": prefilled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256, help="rows a whole-batch call holds, and rows in flight in the stream")
    parser.add_argument("--cap", type=int, default=512, help="the longest response (max_tokens)")
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--budget", type=int, nargs="+", default=[64], help="the stream's tokens a round (one run each)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", choices=["1.7b", "tiny"], default="1.7b")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(rng.randint(100, 300))] for _ in range(args.samples // G)]
    heavy = [args.cap if (r * 7919) % 10 == 0 else args.cap // 8 for r in range(args.samples)]
    uniform = [args.cap] * args.samples
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "rows": args.rows, "cap": args.cap, "samples": args.samples, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(Path(tmp), QWEN3_1_7B if args.model == "1.7b" else TINY)
        engine = TransformersEngine(str(model_dir), dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device)
        warm = prompts[: args.rows // G]
        run_batches(engine, warm, uniform[: len(warm) * G], args.rows, args.cap)  # graphs captured, allocator warm
        cases = result["cases"]
        cases["batches_uniform"] = run_batches(engine, prompts, uniform, args.rows, args.cap)
        cases["batches_heavy"] = run_batches(engine, prompts, heavy, args.rows, args.cap)
        for budget in args.budget:
            run_stream(engine, warm, heavy[: len(warm) * G], args.rows, budget)  # this budget's graphs
            cases[f"stream_heavy_b{budget}"] = run_stream(engine, prompts, heavy, args.rows, budget)
            cases[f"stream_uniform_b{budget}"] = run_stream(engine, prompts, uniform, args.rows, budget)
        base = cases["batches_uniform"]["tokens_per_s"]
        result["share_of_uniform_batches"] = {k: round(v["tokens_per_s"] / base, 3) for k, v in cases.items()}
        engine.shutdown()
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
