"""Where one Tinker ``forward_backward`` spends its time, stage by stage, in one process (no HTTP): the SDK's
request encoding, the server's reading of it into a ``TrainBatch``, the core's ``forward_backward`` (with and
without the log-probs the Tinker reply carries), the prompts' no-grad forward, the reply, and the SDK's decoding
of it; the median and minimum of ``--repeats`` runs of each stage, on ``tinker_overhead.py``'s model and datums.
The two HTTP round trips of a call are ``tinker_overhead.py``'s ``optim_step`` (it does no work).

    python benchmarks/probes/tinker_call_cost.py --repeats 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.tinker_overhead import config_for, datums_of, vocab_of  # noqa: E402


def timed_ms(fn, repeats: int) -> tuple[float, float]:
    """Median and minimum of ``repeats`` calls of ``fn`` after one warm-up call, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    shape = argparse.Namespace(shape="quickstart", engine="transformers", devices=1, sample_tokens=None)
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    import arctic_rl.serve.tinker.losses  # noqa: F401  (registers tinker.*)
    from arctic_rl.serve.config import ArcticRLClientConfig
    from arctic_rl.serve.ranks.ranked import make_core
    from arctic_rl.serve.tinker.batch import check_vocabulary, target_logprobs, target_sources, train_batch
    from arctic_rl.serve.tinker.service import TinkerService
    from arctic_rl.serve.tinker.wire import forward_backward_output, read_forward_backward

    config = config_for(shape, Path(tempfile.mkdtemp()))
    core = make_core(ArcticRLClientConfig.load(config))
    try:
        _, datums, batch = datums_of(shape, vocab_of(config))
        service = TinkerService(core)
        service.model_id = "m"
        core.start()
        vocab = int(core.status()["vocab_size"])
        request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=datums, loss_fn="importance_sampling"), model_id="m", seq_id=1)
        body = forward_backward_request_to_proto(request).SerializeToString()
        call = read_forward_backward(body)
        trained = core.forward_backward(batch, "tinker.importance_sampling", processors=["logprobs"])["outputs"]["logprobs"]
        rest, plan = target_sources(call.datums, batch)
        before = core.forward(rest, ["logprobs"])["logprobs"]
        lengths = [len(d.targets) for d in call.datums]
        reply = service.forward_backward(call)
        stages = {
            "SDK: encode the request": lambda: forward_backward_request_to_proto(request).SerializeToString(),
            "server: read the request": lambda: read_forward_backward(body),
            "server: check the vocabulary": lambda: check_vocabulary(call.datums, vocab),
            "server: datums to a TrainBatch": lambda: train_batch(call.datums, "importance_sampling"),
            "core: forward_backward (as local)": lambda: core.forward_backward(batch, "tinker.importance_sampling"),
            "core: forward_backward + its log-probs": lambda: core.forward_backward(
                batch, "tinker.importance_sampling", processors=["logprobs"]),
            "server: target_sources": lambda: target_sources(call.datums, batch),
            "core: the prompts' no-grad forward": lambda: core.forward(rest, ["logprobs"]),
            "server: the reply": lambda: forward_backward_output(target_logprobs(trained, before, plan, lengths), lengths, {}),
            "SDK: decode the reply": lambda: deserialize_forward_backward_output(reply),
            "server: the whole operation (all server stages)": lambda: service.forward_backward(read_forward_backward(body)),
        }
        for name, fn in stages.items():
            median, least = timed_ms(fn, args.repeats)
            print(f"{median:8.2f} ms (min {least:7.2f})  {name}", flush=True)
        core.zero_grad()
    finally:
        core.close()


if __name__ == "__main__":
    main()
