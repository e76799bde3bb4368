"""Cost of the start-up self-check on a real model shape, against one training step's fwd+bwd.

    python3 benchmarks/self_check_cost.py --backend flex     # on the GPU machine

Qwen3-1.7B shape (random weights, bf16, CUDA), a first batch of 2 prompts x G=8 with 4096-token
prompts and 512-token responses. Reports the self-check's seconds on its first call (what a run pays:
the one-off head measurement and the kernel compile for the probe's small layout included) and on a
second call, and the ZoRRo fwd+bwd of the whole batch (first call and steady state) for scale.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="flex")
    args = parser.parse_args()
    from arctic_rl.modules.models import build_causal_lm
    from arctic_rl.modules.self_check import check_first_batch
    from arctic_rl.rollout.batch import RolloutBatch
    from arctic_rl.zorro import zorro_response_logprobs
    from benchmarks.weight_sync import SHAPES

    torch.manual_seed(0)
    config = {"model_type": "qwen3", "max_position_embeddings": 8192, "tie_word_embeddings": True, **SHAPES["qwen3-1.7b"]}
    model = build_causal_lm(config, "bfloat16").cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab, g, p, r = config["vocab_size"], 8, 4096, 512
    prompts = [torch.randint(0, vocab, (p,)).tolist() for _ in range(2)]
    ids = torch.randint(0, vocab, (2 * g, r), device="cuda")
    mask = torch.ones(2 * g, r, device="cuda")
    batch = RolloutBatch(prompt_token_ids=[q for q in prompts for _ in range(g)], response_ids=ids, response_mask=mask,
                         sampler_logprobs=torch.zeros(2 * g, r, device="cuda"), rewards=torch.zeros(2 * g, device="cuda"),
                         advantages=torch.zeros(2 * g, device="cuda"), group_size=g)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    def step() -> None:
        model.zero_grad(set_to_none=True)
        lp, _ = zorro_response_logprobs(model, batch.prompt_token_ids, ids, mask, 1.0, False, 0, attention_backend=args.backend)
        lp.sum().backward()

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "backend": args.backend, "case": [2, g, p, r]}
    check = lambda: check_first_batch(model, batch, zorro=True, attention_backend=args.backend, temperature=1.0, pad_token_id=0)  # noqa: E731
    result["self_check_first_s"] = round(timed(check), 3)
    result["self_check_again_s"] = round(timed(check), 3)
    result["step_first_s"] = round(timed(step), 3)
    result["step_s"] = round(min(timed(step) for _ in range(3)), 3)
    result["max_gap"] = {k: float(v) for k, v in check().max_gap.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
