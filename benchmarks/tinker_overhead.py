"""What the Tinker transport costs: the same work through ``ArcticRLClient`` (``local``, the core in-process)
and through the unmodified ``tinker`` SDK against ``arctic-rl serve --api tinker`` (a server process on
loopback), the same model and batch in one run; medians of repeated calls after a warm-up.

    python benchmarks/tinker_overhead.py --repeats 20 --out benchmarks/results/tinker_cpu_<date>.json

Operations: ``forward_backward`` (importance sampling over P x G datums; the Tinker route also answers each
target's log-prob: the trained spans' from the loss's own forward, the prompts' from a no-grad forward of each
distinct prompt), ``optim_step``, ``sample`` of one prompt (G completions), and a
GRPO step's sampling: P prompts, which the SDK sends as P requests (the server runs them one after another)
and ``local`` as one call. Shapes as ``service_overhead.py``'s (the quickstart's by default).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.service_overhead import SHAPES, build_config, timed  # noqa: E402

LR = 1e-6


def datums_of(args, vocab: int):
    """P prompts and P x G Tinker datums (the cookbook's layout) of random tokens, and the same as a TrainBatch."""
    from tinker import types

    from arctic_rl.serve.tinker.batch import Datum, train_batch

    _, prompts, g, prompt_len, response_len = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(prompts)]
    sdk, plain = [], []
    for i in range(prompts * g):
        prompt, completion = prompt_ids[i // g], torch.randint(0, vocab, (response_len,), generator=gen).tolist()
        full, p, adv = prompt + completion, prompt_len - 1, float(torch.randn((), generator=gen))
        inputs = {"target_tokens": full[1:], "advantages": [0.0] * p + [adv] * response_len,
                  "logprobs": [0.0] * p + [-5.0] * response_len}
        sdk.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs))
        plain.append(Datum(tokens=full[:-1], targets=full[1:], weights=[1.0] * len(full[1:]),
                           advantages=inputs["advantages"], logprobs=inputs["logprobs"]))
    return prompt_ids, sdk, train_batch(plain, "importance_sampling")


def config_for(args, root: Path) -> dict:
    """``service_overhead``'s config, its response length covering whole sequences (a Tinker datum's forward
    answers every target, the prompt's too), the same for both so the two cores are alike."""
    config = build_config(args, root)
    _, _, _, prompt_len, response_len = SHAPES[args.shape]
    config["sampling"]["max_response_length"] = prompt_len + response_len
    return config


def measure(ops: dict, repeats: int) -> dict:
    out = {}
    for name, fn in ops.items():
        fn()  # warm-up
        times = timed(fn, repeats)
        out[name] = {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}
        print(f"  {name}: median {1e3 * out[name]['median_s']:.1f} ms", flush=True)
    return out


def run_local(args, root: Path) -> dict:
    import arctic_rl.serve.tinker.losses  # noqa: F401  (registers tinker.* in this process)
    from arctic_rl.serve.client import ArcticRLClient

    _, _, g, _, response_len = SHAPES[args.shape]
    config = config_for(args, root / "local")
    with ArcticRLClient(config, protocol="local") as client:
        prompts, _, batch = datums_of(args, vocab_of(config))
        tokens = args.sample_tokens or response_len
        ops = {"forward_backward": lambda: client.forward_backward(batch, "tinker.importance_sampling"),
               "optim_step": lambda: client.optim_step(lr=LR),
               "sample_one_prompt": lambda: client.sample(prompts[:1], n=g, max_tokens=tokens, seed=0),
               "sample_all_prompts": lambda: client.sample(prompts, n=g, max_tokens=tokens, seed=0)}
        return measure(ops, args.repeats)


def run_tinker(args, root: Path) -> dict:
    import tinker
    from tinker import types

    from arctic_rl.serve.server import start_server_process

    _, _, g, _, response_len = SHAPES[args.shape]
    token = f"tml-{secrets.token_urlsafe(16)}"
    config = config_for(args, root / "tinker")
    server = start_server_process(config, api="tinker", token=token, startup_timeout_s=600,
                                  env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    try:
        service = tinker.ServiceClient(base_url=server.url, api_key=token)
        model = service.get_server_capabilities().supported_models[0].model_name  # the name the server trains
        training = service.create_lora_training_client(base_model=model, rank=0).result()
        prompts, datums, _ = datums_of(args, vocab_of(config))
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=args.sample_tokens or response_len, seed=0)

        def sample(some):
            futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=g, sampling_params=params) for p in some]
            return [f.result() for f in futures]

        ops = {"forward_backward": lambda: training.forward_backward(datums, "importance_sampling").result(),
               "optim_step": lambda: training.optim_step(types.AdamParams(learning_rate=LR)).result(),
               "sample_one_prompt": lambda: sample(prompts[:1]), "sample_all_prompts": lambda: sample(prompts)}
        return measure(ops, args.repeats)
    finally:
        server.stop()


def vocab_of(config: dict) -> int:
    """Token ids the batches draw from: the tokenizer's (the model's vocabulary is at least as large)."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(config["tokenizer"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="quickstart")
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sample-tokens", type=int, help="tokens per sample call (default: the shape's response length)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--devices", type=int, default=1, help="training.devices (ranks), as service_overhead.py")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("local", run_local), ("tinker", run_tinker)):
            print(name, flush=True)
            results[name] = run(args, Path(tmp))
    for op, local in results["local"].items():
        extra = results["tinker"][op]["median_s"] - local["median_s"]
        results["tinker"][op].update(overhead_s=extra, overhead_share=extra / local["median_s"])
    record = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "shape": args.shape,
              "load_average": os.getloadavg(), "device": f"cpu x{torch.get_num_threads()}",
              "command": " ".join(sys.argv), "results": results}
    print(json.dumps({p: {op: {k: v for k, v in r.items() if k != "times_s"} for op, r in ops.items()}
                      for p, ops in results.items()}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
