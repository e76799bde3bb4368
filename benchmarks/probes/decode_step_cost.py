"""Probe: what one decode step of the transformers engine costs at each batch size, and where it goes.

Qwen3-1.7B shape (random weights, bf16), prompts of 200 tokens, a 456-position attention window. For rows in
``--rows``: ms per step as CUDA-graph replays and eagerly; then a kernel profile of eager steps at two sizes
(top kernels by GPU time, kernels per step); then, with ``--compile``, the same replays with each decoder
layer's forward under ``torch.compile`` (fusing the elementwise work between the matmuls).

    python benchmarks/probes/decode_step_cost.py --rows 8,32,256 --compile --out decode_step.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.hf_engine_gpu import build_model_dir  # noqa: E402

PROMPT, WINDOW, MAX_TOKENS = 200, 456, 512


def make_run(engine, rows: int):
    from arctic_rl.rollout.engines.transformers.decode import _Run
    from arctic_rl.rollout.engines.transformers.sampling import uniform_table

    prompts = [[100 + (i * 7 + j) % 40000 for j in range(PROMPT)] for i in range(rows)]
    run = _Run(engine.decoder, prompts, 1, MAX_TOKENS, uniform_table(None, rows, MAX_TOKENS, engine.device), 1.0, 1.0)
    run._prefill()
    return run


def ms_per_step(engine, rows: int, graphs: bool, steps: int = 30) -> float:
    engine.decoder.cuda_graphs = graphs
    run = make_run(engine, rows)
    try:
        for _ in range(3):
            run._step(rows, WINDOW)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            run._step(rows, WINDOW)
        torch.cuda.synchronize()
        return 1000 * (time.perf_counter() - started) / steps
    finally:
        run.release()
        del run
        torch.cuda.empty_cache()
        ALLOCATED_AFTER.append((rows, graphs, torch.cuda.memory_allocated() / 2**30))


ALLOCATED_AFTER: list = []  # (rows, graphs, GiB still allocated after the run was released): a leak shows here


def profile(engine, rows: int, steps: int = 3) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    engine.decoder.cuda_graphs = False
    run = make_run(engine, rows)
    run._step(rows, WINDOW)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run._step(rows, WINDOW)
        torch.cuda.synchronize()
    run.release()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:20]
    return {"rows": rows, "kernels_per_step": len(kernels) / steps,
            "gpu_ms_per_step": sum(e.device_time for e in kernels) / steps / 1000,
            "top": [{"kernel": k, "per_step": len(v) / steps, "us_per_step": sum(v) / steps} for k, v in top]}


def compile_layers(engine) -> None:
    for layer in engine.model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,16,32,64,128,256")
    parser.add_argument("--profile-rows", default="32,256")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--skip-eager", action="store_true", help="only the CUDA-graph (and compiled) timings")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

    torch.set_grad_enabled(False)  # as BatchedDecoder.decode: eager steps under autograd keep every step's graph alive
    rows_list = [int(r) for r in args.rows.split(",")]
    result: dict = {"command": " ".join(sys.argv), "window": WINDOW, "prompt": PROMPT, "device": torch.cuda.get_device_name()}

    def dump():
        print(json.dumps(result), flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        engine = TransformersEngine(str(build_model_dir(Path(tmp))), dtype="bfloat16", device="cuda")
        result["graph_ms"] = {r: ms_per_step(engine, r, True) for r in rows_list}
        result["allocated_after_gib"] = ALLOCATED_AFTER
        dump()
        if not args.skip_eager:
            result["eager_ms"] = {r: ms_per_step(engine, r, False) for r in rows_list}
            dump()
            result["profile"] = [profile(engine, int(r)) for r in args.profile_rows.split(",")]
            dump()
        if args.compile:
            compile_layers(engine)
            started = time.perf_counter()
            result["compiled_graph_ms"] = {}
            for r in rows_list:
                result["compiled_graph_ms"][r] = ms_per_step(engine, r, True)
                result.setdefault("compile_and_first_s", {})[r] = time.perf_counter() - started
                started = time.perf_counter()
                dump()
        engine.shutdown()
    dump()


if __name__ == "__main__":
    main()
