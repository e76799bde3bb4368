"""What agent rollouts (``model.rollout.agent``) cost over the engine: one rollout batch of the agent toy (8 rows x 8
episodes, two requests each) three ways, in one process, one after another:

- ``engine``: the same two turns straight through ``engine.generate`` (one call per turn for all 64 episodes), the
  floor for any way of running them;
- ``agents``: ``run_agents`` with the toy's ``openai``-SDK agent against the endpoint on loopback (what ``fit`` runs);
- ``sdk_floor``: the same 128 SDK requests against a server that answers each with a canned completion (no rendering,
  no engine): what the ``openai`` SDK and HTTP alone cost in this process.

    python benchmarks/agent_rollout_cpu.py --repeats 5 --out benchmarks/results/agent_rollout_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch
from fastapi import FastAPI, Request  # module level: the route's annotations are resolved here
from fastapi.responses import JSONResponse

ROWS, G = 8, 8


def _model(out: Path, tokenizer) -> Path:
    from arctic_rl.modules.models import build_causal_lm
    from arctic_rl.tasks.toy import tiny_qwen3_config

    torch.manual_seed(0)
    build_causal_lm(tiny_qwen3_config(len(tokenizer)), "float32").save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def engine_only(engine, tokenizer, prompts) -> float:
    from arctic_rl.rollout.engines.base import SamplingConfig

    started = time.perf_counter()
    first = engine.generate([p for p in prompts for _ in range(G)], SamplingConfig(n=1, max_tokens=2, seed=1))
    tool = tokenizer.encode("<|endoftext|> <|im_start|> tool 7 <|endoftext|> <|im_start|> assistant", add_special_tokens=False)
    second = [p + out[0].token_ids + tool for p, out in zip([p for p in prompts for _ in range(G)], first)]
    engine.generate(second, SamplingConfig(n=1, max_tokens=2, seed=2))
    return time.perf_counter() - started


def agents(engine, tokenizer, rows, prompts) -> float:
    from arctic_rl.options import AgentOptions
    from arctic_rl.rollout.engines.base import SamplingConfig
    from arctic_rl.rollout.openai.agents import run_agents

    options = AgentOptions("arctic_rl.tasks.agent_toy.lookup_agent", max_in_flight=ROWS * G, max_turns=2)
    started = time.perf_counter()
    run_agents(engine, options, tokenizer, rows, prompts, G, SamplingConfig(n=G, max_tokens=20, seed=0), 8)
    return time.perf_counter() - started


def sdk_floor(url: str) -> float:
    import httpx
    import openai

    async def batch() -> None:
        limits = httpx.Limits(max_connections=ROWS * G, max_keepalive_connections=ROWS * G)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                    http_client=openai.DefaultAsyncHttpxClient(limits=limits))

        async def one(i: int) -> None:
            episode = client.with_options(default_headers={"X-Session-Id": str(i)})
            for _ in range(2):
                await episode.chat.completions.create(model="m", messages=[{"role": "user", "content": "code ?"}], max_tokens=2)

        await asyncio.gather(*(one(i) for i in range(ROWS * G)))
        await client.close()

    started = time.perf_counter()
    asyncio.run(batch())
    return time.perf_counter() - started


def canned_app():
    answer = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "7"}, "finish_reason": "stop", "logprobs": None}],
              "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> JSONResponse:
        await request.body()
        return JSONResponse(answer)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/arctic-rl-agent-bench"))
    args = parser.parse_args()

    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine
    from arctic_rl.rollout.openai.agent_server import close_agent_server
    from arctic_rl.tasks.agent_toy import build_agent_tokenizer, make_rows
    from tests.helpers import app_on_loopback

    tokenizer = build_agent_tokenizer()
    engine = TransformersEngine(str(_model(args.workdir, tokenizer)))
    rows = make_rows(ROWS, 0)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for r in rows]
    seconds: dict[str, list[float]] = {"engine": [], "agents": [], "sdk_floor": []}
    with app_on_loopback(canned_app()) as url:
        for _ in range(args.repeats + 1):  # the first of each is a warm-up
            seconds["engine"].append(engine_only(engine, tokenizer, prompts))
            seconds["agents"].append(agents(engine, tokenizer, rows, prompts))
            seconds["sdk_floor"].append(sdk_floor(url))
    close_agent_server()
    engine.shutdown()
    result = {name: {"median_s": statistics.median(v[1:]), "min_s": min(v[1:])} for name, v in seconds.items()}
    result["requests"] = ROWS * G * 2
    for name in ("engine", "agents", "sdk_floor"):
        print(f"{name:>10}: median {result[name]['median_s']:.3f} s (min {result[name]['min_s']:.3f} s) for one batch")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
