"""Synchronous vs overlapped rollouts (``RolloutCallback.max_staleness``) on the CPU quickstart.

    python benchmarks/overlap_cpu.py --seeds 0,1,2 --out benchmarks/results/overlap_cpu_<date>.json

Runs the README's quickstart (``benchmarks/quickstart.py``'s ``one_run``: a fresh ``arctic-rl fit``
process per run, 200 steps) in each mode named by ``--modes``, seed by seed, the modes alternating so a
busy machine slows them alike:

- ``sync_ray``: one vLLM engine in a Ray actor, ``max_staleness: 0`` (today's step: rollout, train, push);
- ``overlap_ray``: the same engine actor, ``max_staleness: 1`` (batch t+1 generated while batch t trains);
- ``sync_local`` / ``overlap_local``: the in-process engine (overlap: generation in a background thread of
  the training process, competing with training for the same cores).

Per run: the median step (``StepClock``: one step's start to the next's), the medians of the run's timing
metrics (``timing/rollout_wait_s`` is what the trainer waited for rollouts in an overlapped step), the wall,
the first/last-10-step reward means and the step where the 10-step mean first reaches 0.9.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quickstart import one_run  # noqa: E402

MODES = {
    "sync_ray": {"max_staleness": 0, "ray": {"num_engines": 1, "num_cpus_per_engine": 1}},
    "overlap_ray": {"max_staleness": 1, "ray": {"num_engines": 1, "num_cpus_per_engine": 1}},
    "sync_local": {"max_staleness": 0},
    "overlap_local": {"max_staleness": 1},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--modes", default="sync_ray,overlap_ray")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--out")
    args = parser.parse_args()
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for mode in args.modes.split(","):
            run = {"mode": mode, **one_run(seed, args.max_steps, {}, MODES[mode])}
            runs.append(run)
            print(json.dumps(run), flush=True)
    result = {"benchmark": "overlap_cpu", "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(), "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
