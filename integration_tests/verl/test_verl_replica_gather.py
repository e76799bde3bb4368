"""``ArcticRLServer`` gathers verl's per-sample ``generate`` requests into one ``client.sample``: each request keeps
its own seed (``request_seed``), so its tokens are those of its own call; the gathering rules (window, ``max_batch``,
one call per set of sampling arguments, errors to every waiter) on a stand-in ``sample_many``.

The server runs here without Ray: ``InProcessWorker`` stands in for the verl worker handle, its ``__ray_call__``
running the function in this process as Ray runs it in the worker's; the client is a real arctic-rl core (tiny Qwen3).
"""

from __future__ import annotations

import asyncio

import pytest

from arctic_rl.integrations import verl_replica
from arctic_rl.integrations.verl_replica import ArcticRLServer, RequestGatherer, request_seed

PARAMS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


class InProcessWorker:
    """A verl worker handle whose ``__ray_call__.remote(fn, *args)`` runs ``fn(worker, *args)`` in a thread here."""

    class _RayCall:
        def remote(self, fn, *args, **kwargs):
            return asyncio.to_thread(fn, None, *args, **kwargs)

    def __init__(self):
        self.__ray_call__ = self._RayCall()


@pytest.fixture(scope="module")
def worker_client(tiny_model_dir, tmp_path_factory):
    from arctic_rl.serve.client import ArcticRLClient

    client = ArcticRLClient({"model": str(tiny_model_dir), "training": {"accelerator": "cpu"},
                             "server": {"root_dir": str(tmp_path_factory.mktemp("gather"))},
                             "engines": {"engine": "transformers"}, "sampling": {"max_prompt_length": 32, "max_response_length": 8}})
    verl_replica.register_worker_client(client)
    yield client
    client.close()
    verl_replica.unregister_worker_client(client)


def toy_prompts(model_dir, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from arctic_rl.tasks.toy import make_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in make_rows(count, seed=3)]


def generate_all(server: ArcticRLServer, prompts, ids, params=PARAMS):
    async def run():
        return await asyncio.gather(*(server.generate(i, prompt_ids=p, sampling_params=params) for i, p in zip(ids, prompts)))
    return asyncio.run(run())


def test_gathered_requests_get_the_tokens_of_their_own_calls(worker_client, tiny_model_dir):
    """8 concurrent requests (two per prompt, as ``rollout.n`` sends them) -> one ``client.sample`` of 8 prompts;
    each request's tokens and log-probs equal a ``client.sample`` of its prompt alone with its ``request_seed``."""
    prompts = [p for p in toy_prompts(tiny_model_dir, 4) for _ in range(2)]
    ids = [f"req-{i}" for i in range(len(prompts))]
    calls, sample = [], worker_client.sample

    def counting_sample(prompts, **kwargs):
        calls.append(len(prompts))
        return sample(prompts, **kwargs)

    worker_client.sample = counting_sample
    try:
        outs = generate_all(ArcticRLServer(InProcessWorker(), response_length=8, window_s=0.2), prompts, ids)
    finally:
        worker_client.sample = sample
    assert calls == [len(prompts)]
    for request_id, prompt, out in zip(ids, prompts, outs):
        alone = worker_client.sample([prompt], n=1, max_tokens=8, prompt_seeds=[request_seed(request_id, PARAMS)])
        assert out.token_ids == alone.flat_token_ids()[0]
        assert out.log_probs == pytest.approx(alone.flat_logprobs()[0], abs=1e-5)
    assert len({tuple(out.token_ids) for out in outs}) > len(prompts) // 2  # the two samples of a prompt differ


def test_request_seed_is_the_callers_or_a_hash_of_the_request_id():
    assert request_seed("a", {"seed": 7}) == 7
    assert request_seed("a", {}) == request_seed("a", {"seed": None}) != request_seed("b", {})
    assert 0 <= request_seed("a", {}) < 2 ** 63


def test_gatherer_splits_at_max_batch_and_by_sampling_arguments():
    """``max_batch`` requests go at once; requests with other arguments go in their own call; each request gets
    its own result back; an error of the call reaches every request of it."""
    calls = []

    async def sample_many(prompts, seeds, **arguments):
        calls.append((len(prompts), arguments["max_tokens"]))
        if arguments["max_tokens"] == 1:
            raise RuntimeError("engine failed")
        return [{"token_ids": p + [s]} for p, s in zip(prompts, seeds)]

    async def run():
        gatherer = RequestGatherer(sample_many, window_s=0.05, max_batch=3)
        jobs = [gatherer.submit([i], 100 + i, {"max_tokens": 4 if i < 5 else 2}) for i in range(7)]
        failing = [gatherer.submit([9], 9, {"max_tokens": 1})]
        return await asyncio.gather(*jobs, *failing, return_exceptions=True)

    results = asyncio.run(run())
    assert sorted(calls) == [(1, 1), (2, 2), (2, 4), (3, 4)]
    assert [r["token_ids"] for r in results[:7]] == [[i, 100 + i] for i in range(7)]
    assert isinstance(results[7], RuntimeError)


def test_a_cancelled_request_leaves_the_others_of_its_call_answered():
    async def sample_many(prompts, seeds, **arguments):
        return [{"token_ids": p} for p in prompts]

    async def run():
        gatherer = RequestGatherer(sample_many, window_s=0.05)
        tasks = [asyncio.ensure_future(gatherer.submit([i], i, {"max_tokens": 4})) for i in range(3)]
        await asyncio.sleep(0)
        tasks[1].cancel()  # verl gave up on one request before the window closed
        return await asyncio.gather(*tasks, return_exceptions=True)

    first, cancelled, last = asyncio.run(run())
    assert first == {"token_ids": [0]} and last == {"token_ids": [2]}
    assert isinstance(cancelled, asyncio.CancelledError)
