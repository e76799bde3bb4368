"""What gathering verl's per-sample ``generate`` requests saves: ``ArcticRLServer`` answering a batch of concurrent
requests (as verl's agent loop sends them: one per sample) one ``client.sample`` each (``max_batch=1``, the
replica's behaviour before gathering) against one gathered ``client.sample`` (``RequestGatherer``), same requests,
same seeds, same run; the tokens of every request must be equal between the two.

    PYTHONPATH=.venv/site-verl:. python benchmarks/verl_replica_gather.py --requests 20,64 --repeats 5 \
        --out benchmarks/results/verl_replica_gather_<date>.json

Runs without Ray (the worker handle's ``__ray_call__`` runs in this process), on the quickstart's tiny Qwen3 with the
transformers engine on CPU, so it measures the arctic-rl side only: each ungathered request would also pay a Ray
actor call in verl. Reported per batch size: median wall time of the batch in each mode and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


class InProcessWorker:
    """A verl worker handle whose ``__ray_call__.remote(fn, *args)`` runs ``fn(worker, *args)`` in a thread here."""

    class _RayCall:
        def remote(self, fn, *args, **kwargs):
            return asyncio.to_thread(fn, None, *args, **kwargs)

    def __init__(self):
        self.__ray_call__ = self._RayCall()


def run_batch(server, prompts, ids) -> tuple[float, list[list[int]]]:
    async def run():
        return await asyncio.gather(*(server.generate(i, prompt_ids=p, sampling_params=PARAMS) for i, p in zip(ids, prompts)))
    start = time.perf_counter()
    outs = asyncio.run(run())
    return time.perf_counter() - start, [out.token_ids for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", default="20,64", help="batch sizes: concurrent requests (prompts x rollout.n)")
    parser.add_argument("--group", type=int, default=5, help="requests per prompt (verl's rollout.n)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=float, default=0.02, help="the gatherer's window in seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from arctic_rl.integrations import verl_replica
    from arctic_rl.serve.client import ArcticRLClient
    from arctic_rl.tasks.toy import make_rows, write_tiny_model

    load_before = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="verl-gather-"))
    model_dir = write_tiny_model(root / "model", seed=0)
    client = ArcticRLClient({"model": str(model_dir), "training": {"accelerator": "cpu"},
                             "server": {"root_dir": str(root / "arctic")},
                             "engines": {"engine": "transformers"}, "sampling": {"max_prompt_length": 32, "max_response_length": 8}})
    verl_replica.register_worker_client(client)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    servers = {"per_request": verl_replica.ArcticRLServer(InProcessWorker(), 8, window_s=args.window, max_batch=1),
               "gathered": verl_replica.ArcticRLServer(InProcessWorker(), 8, window_s=args.window)}
    client.sample([[1, 2, 3]], n=1, max_tokens=8)  # starts the engine: not timed
    rows = []
    for count in [int(x) for x in args.requests.split(",")]:
        rows_of_prompts = make_rows(-(-count // args.group), seed=count)
        prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows_of_prompts
                   for _ in range(args.group)][:count]
        times = {mode: [] for mode in servers}
        for repeat in range(args.repeats):  # the modes alternate, so the machine's load falls on both alike
            ids = [f"{count}-{repeat}-{i}" for i in range(count)]
            tokens = {}
            for mode, server in servers.items():
                seconds, tokens[mode] = run_batch(server, prompts, ids)
                times[mode].append(seconds)
            if tokens["per_request"] != tokens["gathered"]:
                raise SystemExit(f"{count} requests, repeat {repeat}: gathered tokens differ from per-request tokens")
        medians = {mode: statistics.median(t) for mode, t in times.items()}
        rows.append({"requests": count, "per_request_s": medians["per_request"], "gathered_s": medians["gathered"],
                     "speedup": medians["per_request"] / medians["gathered"], "tokens_equal": True,
                     "times": times})
        print(f"{count:4d} requests: per-request {medians['per_request']:.3f} s, gathered {medians['gathered']:.3f} s "
              f"({medians['per_request'] / medians['gathered']:.1f}x), tokens equal")
    client.close()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_average_1min": [load_before[0], os.getloadavg()[0]],
              "window_s": args.window,
              "repeats": args.repeats, "group": args.group, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
