"""The Tinker ``forward_backward`` of two checkouts of arctic-rl, call by call: one ``arctic-rl serve --api tinker``
server per checkout (``--before`` and this one) and ``local`` (this checkout's core, in this process), each
call of the three in turn, so that a shared machine's load falls on all of them alike; medians and minima of
``--repeats`` rounds after a warm-up. Same model, datums and loss as ``tinker_overhead.py``.

    python benchmarks/tinker_ab.py --before /path/to/main/checkout --repeats 40 --out benchmarks/results/tinker_ab_cpu_<date>.json
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.tinker_overhead import config_for, datums_of, vocab_of  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout's root (its server runs from it)")
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    shape = argparse.Namespace(shape="quickstart", engine=args.engine, devices=1, sample_tokens=None)
    import tinker

    import arctic_rl.serve.tinker.losses  # noqa: F401  (registers tinker.* for local)
    from arctic_rl.serve.client import ArcticRLClient
    from arctic_rl.serve.server import start_server_process

    servers, calls = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # ``python -m`` puts the working directory first on a server's path: neither checkout's
        try:
            for name, checkout in (("tinker_before", args.before.resolve()), ("tinker_after", ROOT)):
                config, token = config_for(shape, Path(tmp) / name), f"tml-{secrets.token_urlsafe(16)}"
                server = start_server_process(config, api="tinker", token=token, startup_timeout_s=600,
                                              env={"PYTHONPATH": str(checkout)})
                servers.append(server)
                service = tinker.ServiceClient(base_url=server.url, api_key=token)
                model = service.get_server_capabilities().supported_models[0].model_name
                training = service.create_lora_training_client(base_model=model, rank=0).result()
                _, datums, _ = datums_of(shape, vocab_of(config))
                calls[name] = lambda t=training, d=datums: t.forward_backward(d, "importance_sampling").result()
            config = config_for(shape, Path(tmp) / "local")
            with ArcticRLClient(config, protocol="local") as client:
                _, _, batch = datums_of(shape, vocab_of(config))
                calls["local"] = lambda: client.forward_backward(batch, "tinker.importance_sampling")
                times: dict[str, list[float]] = {name: [] for name in calls}
                for round_ in range(args.repeats + 1):
                    for name, call in calls.items():
                        start = time.perf_counter()
                        call()
                        if round_:  # round 0 warms every path up
                            times[name].append(time.perf_counter() - start)
        finally:
            for server in servers:
                server.stop()
    local = statistics.median(times["local"])
    results = {name: {"median_s": statistics.median(t), "min_s": min(t), "vs_local_median": statistics.median(t) / local,
                      "vs_local_min": min(t) / min(times["local"]), "times_s": t} for name, t in times.items()}
    for name, r in results.items():
        print(f"{name:14s} median {1e3 * r['median_s']:6.1f} ms (min {1e3 * r['min_s']:6.1f})  "
              f"x local: {r['vs_local_median']:.2f} (min/min {r['vs_local_min']:.2f})", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": platform.node(),
                                        "load_average": os.getloadavg(), "command": " ".join(sys.argv),
                                        "before": str(args.before), "results": results}, indent=1))


if __name__ == "__main__":
    main()
