"""The rollout engines at the quickstart's size on CPU: one step's generation (16 prompts x 8 samples x 8
tokens, the quickstart's prompts and sampling) with vLLM and with the transformers engine, alternated.

    python benchmarks/probes/engine_generate_cpu.py --repeats 30

Prints each engine's median and min per generate call and the ratio; ``transformers_per_prompt`` is the
transformers engine called once per prompt (how it sampled before it batched prompts of equal length). Both engines hold the same weights
(the quickstart's model, seed 0) and sample with per-sample seeds, as the rollout callback does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from arctic_rl.rollout.engines.vllm.env import apply_vllm_env_defaults

    apply_vllm_env_defaults()
    from arctic_rl.rollout.engines.base import SamplingConfig
    from arctic_rl.rollout.engines.factory import make_engine
    from arctic_rl.rollout.engines.seeds import prompt_seeds
    from arctic_rl.tasks.toy import make_rows, tiny_qwen3_config

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "data/toy/tokenizer")
    config = tiny_qwen3_config(len(tokenizer))
    model_type = config.pop("model_type")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config)).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                               tokenize=False) for r in make_rows(16, seed=0)]
        prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        engines = {kind: make_engine(kind, tmp, dtype="float32", max_model_len=40, seed=0, device="cpu", engine_kwargs={})
                   for kind in ("vllm", "transformers")}
        times: dict[str, list[float]] = {kind: [] for kind in [*engines, "transformers_per_prompt"]}
        for step in range(args.repeats + 1):
            seeds = prompt_seeds(0, step, len(prompts))
            sampling = SamplingConfig(n=8, max_tokens=8, seed=0, prompt_seeds=seeds)
            for kind in times:
                start = time.perf_counter()
                if kind == "transformers_per_prompt":  # how the engine sampled before it batched prompts
                    for prompt, seed in zip(prompts, seeds):
                        engines["transformers"].generate([prompt], SamplingConfig(n=8, max_tokens=8, prompt_seeds=(seed,)))
                else:
                    engines[kind].generate(prompts, sampling)
                if step:  # the first call warms up (compilation, caches)
                    times[kind].append(time.perf_counter() - start)
        for engine in engines.values():
            engine.shutdown()
    result = {kind: {"median_s": statistics.median(t), "min_s": min(t)} for kind, t in times.items()}
    result["transformers_over_vllm"] = result["transformers"]["median_s"] / result["vllm"]["median_s"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
