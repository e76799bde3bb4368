"""verl 0.9.1 agent-loop rollouts from arctic-rl: ``actor_rollout_ref.rollout.name: arctic_rl`` registers a
``RolloutReplica`` whose server answers the agent loop's ``generate`` calls with the actor's ``ArcticRLClient``.

Why this shape: ``verl.trainer.main_ppo`` (``RayPPOTrainer.fit``) samples only through the agent loop, which
sends one ``generate(request_id, prompt_ids, sampling_params)`` per sample to a server actor of a replica
from ``RolloutReplicaRegistry``. In verl's hybrid mode (the default: actor and rollout share each worker) the
replica gets the actor workers' handles; the arctic-rl core already lives in the actor worker (its engine's
client), so the server is a thin Ray actor that runs the requests in that worker process (``__ray_call__``)
as ``client.sample``: the policy samples from the same core it trains, weights never move. The agent loop sends
a batch's requests at once; ``RequestGatherer`` turns those arriving within a short window into one
``client.sample`` (one engine batch instead of one per sample), each sample drawn from its request's own seed.
Only the hybrid mode is offered; colocated and standalone replicas (separate rollout processes) are refused.

The worker-side half is ``ArcticRLRollout`` (verl's ``BaseRollout``, in ``verl.py``), which verl's worker builds
from ``rollout.name``; its ``update_weights`` is arctic-rl's ``sync_weights``. Both halves find the worker's
client through ``worker_client()``: the one ``ArcticRLEngine`` of the process registers it when it starts.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import ray
from verl.workers.rollout import base as verl_rollout_base
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

from arctic_rl.integrations.verl_mapping import UnsupportedVerlSetting

NAME = "arctic_rl"
_clients: list = []  # the ArcticRLClient of this process's ArcticRLEngine (verl starts one actor engine per worker)


def register_worker_client(client) -> None:
    """Called by ``ArcticRLEngine.initialize``: the client the rollout of this worker process samples with."""
    if client not in _clients:
        _clients.append(client)


def unregister_worker_client(client) -> None:
    """The inverse of ``register_worker_client``, once ``client`` is closed (a process that builds another engine)."""
    _clients.remove(client)


def worker_client():
    """The ``ArcticRLClient`` of this verl worker's actor engine (exactly one per process)."""
    if len(_clients) != 1:
        raise RuntimeError(f"the {NAME} rollout needs exactly one arctic_rl actor engine in its verl worker process, "
                           f"found {len(_clients)}: the rollout shares the actor's worker (verl's hybrid engine, "
                           "actor_rollout_ref.actor.strategy=arctic_rl)")
    return _clients[0]


def _wake(_worker):
    """Run in the verl worker's process (``__ray_call__`` passes the worker actor, unused)."""
    worker_client().wake()


def _sleep(_worker):
    worker_client().sleep()


def _sample_many(_worker, prompts: list[list[int]], seeds: list[int], max_tokens: int, temperature: float,
                 top_p: float) -> list[dict]:
    """One ``client.sample`` for gathered requests: one sample of each prompt, from its own seed's stream."""
    samples = worker_client().sample([list(p) for p in prompts], n=1, max_tokens=max_tokens, temperature=temperature,
                                     top_p=top_p, prompt_seeds=list(seeds))
    return [{"token_ids": t, "log_probs": lp} for t, lp in zip(samples.flat_token_ids(), samples.flat_logprobs())]


def request_seed(request_id: Any, sampling_params: dict[str, Any]) -> int:
    """A request's seed: ``sampling_params["seed"]`` when the caller sets one, else a hash of verl's
    ``request_id``. Its sample draws from that seed's stream alone, so gathering never changes its tokens."""
    if sampling_params.get("seed") is not None:
        return int(sampling_params["seed"])
    digest = hashlib.blake2b(str(request_id).encode(), digest_size=8, person=b"verl-request").digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class RequestGatherer:
    """Gathers concurrent ``generate`` requests into one ``sample`` call: verl's agent loop sends one request
    per sample, all of a batch at once. A request waits at most ``window_s`` for others with the same sampling
    arguments; ``max_batch`` of them (verl's ``rollout.max_num_seqs``) go at once. ``sample_many(prompts, seeds,
    **arguments)`` returns one ``{"token_ids", "log_probs"}`` per prompt; its error reaches every request."""

    def __init__(self, sample_many, window_s: float = 0.02, max_batch: int = 1024):
        self.sample_many, self.window_s, self.max_batch = sample_many, window_s, max_batch
        self._pending: dict[tuple, list] = {}  # sampling arguments -> [(prompt, seed, future)]
        self._running: set[asyncio.Task] = set()  # the event loop keeps only weak references to tasks

    async def submit(self, prompt_ids: list[int], seed: int, arguments: dict[str, Any]) -> dict:
        key = tuple(sorted(arguments.items()))
        future = asyncio.get_running_loop().create_future()
        group = self._pending.setdefault(key, [])
        group.append((prompt_ids, seed, future))
        if len(group) >= self.max_batch:
            self._flush(key, group)
        elif len(group) == 1:
            asyncio.get_running_loop().call_later(self.window_s, self._flush, key, group)
        return await future

    def _flush(self, key: tuple, group: list) -> None:
        if self._pending.get(key) is group:  # else already sent (full) and a new group started under this key
            del self._pending[key]
            task = asyncio.ensure_future(self._run(dict(key), group))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, arguments: dict[str, Any], group: list) -> None:
        try:
            outs = await self.sample_many([p for p, _, _ in group], [s for _, s, _ in group], **arguments)
        except Exception as error:  # noqa: BLE001 - every waiting request gets the error
            for _, _, future in group:
                if not future.done():  # a request its caller cancelled meanwhile
                    future.set_exception(error)
            return
        for (_, _, future), out in zip(group, outs):
            if not future.done():
                future.set_result(out)


def sampling_arguments(sampling_params: dict[str, Any], response_length: int) -> dict[str, Any]:
    """The agent loop's ``sampling_params`` as ``ArcticRLClient.sample`` arguments; what it cannot honour is
    refused by name (greedy, top-k, a repetition penalty)."""
    temperature = float(sampling_params.get("temperature", 1.0))
    if temperature <= 0:
        raise UnsupportedVerlSetting("greedy generation (temperature 0, e.g. validation with val_kwargs.do_sample: false) "
                                     "is not offered by the arctic_rl rollout; sample at the rollout temperature")
    if sampling_params.get("top_k", -1) not in (-1, 0, None):
        raise UnsupportedVerlSetting(f"actor_rollout_ref.rollout.top_k={sampling_params['top_k']}: the arctic_rl "
                                     "rollout samples without top-k; set -1")
    if float(sampling_params.get("repetition_penalty", 1.0)) != 1.0:
        raise UnsupportedVerlSetting("a repetition_penalty other than 1.0 is not offered by the arctic_rl rollout")
    max_tokens = min(int(sampling_params.get("max_tokens", response_length)), response_length)
    return {"max_tokens": max_tokens, "temperature": temperature, "top_p": float(sampling_params.get("top_p", 1.0))}


class ArcticRLServer:
    """The replica's server actor (``ray.remote`` at launch): verl's ``generate`` and sleep/wake calls, each run
    on the hybrid worker that holds the arctic-rl client."""

    def __init__(self, worker, response_length: int, window_s: float = 0.02, max_batch: int = 1024):
        self.worker, self.response_length = worker, response_length
        self.gatherer = RequestGatherer(self._sample_many, window_s, max_batch)

    async def _sample_many(self, prompts, seeds, **arguments) -> list[dict]:
        return await self.worker.__ray_call__.remote(_sample_many, prompts, seeds, **arguments)

    async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, audio_data=None, **kwargs) -> TokenOutput:
        """One sample of ``prompt_ids``, gathered with concurrent requests into one ``client.sample``."""
        if image_data is not None or video_data is not None or audio_data is not None:
            raise UnsupportedVerlSetting("multimodal prompts are not offered by the arctic_rl rollout")
        arguments = sampling_arguments(sampling_params, self.response_length)
        out = await self.gatherer.submit(list(prompt_ids), request_seed(request_id, sampling_params), arguments)
        return TokenOutput(token_ids=out["token_ids"], log_probs=out["log_probs"], stop_reason="completed")

    async def wake_up(self):
        await self.worker.__ray_call__.remote(_wake)

    async def sleep(self):
        await self.worker.__ray_call__.remote(_sleep)

    async def clear_kv_cache(self):
        """arctic-rl's engines keep no cache between ``sample`` calls."""

    async def release_kv_cache(self):
        await self.sleep()

    async def resume_kv_cache(self):
        await self.wake_up()

    async def abort_all_requests(self, reject_request: bool = False):
        raise UnsupportedVerlSetting("partial rollouts (abort_all_requests) are not offered by the arctic_rl rollout")

    async def resume_generation(self):
        """Nothing is ever paused (see ``abort_all_requests``)."""


class ArcticRLReplica(RolloutReplica):
    """A verl rollout replica served by the arctic-rl core of its (one) hybrid actor worker."""

    async def launch_servers(self):
        if self.rollout_mode != RolloutMode.HYBRID or len(self.workers) != 1:
            raise UnsupportedVerlSetting(
                f"the {NAME} rollout runs in verl's hybrid engine only, one worker per replica (got mode "
                f"{self.rollout_mode}, {len(self.workers)} workers): keep actor_rollout_ref.hybrid_engine=true and "
                "rollout.tensor_model_parallel_size/data_parallel_size/pipeline_model_parallel_size at 1")
        server = ray.remote(ArcticRLServer).options(
            num_cpus=0, name=f"arctic_rl_server_{self.replica_rank}{self.name_suffix}", max_concurrency=self.max_concurrency,
        ).remote(self.workers[0], self.config.response_length, max_batch=self.config.max_num_seqs)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"arctic_rl-replica-{self.replica_rank}{self.name_suffix}"  # a routing key: no HTTP server


def register() -> None:
    """Make ``rollout.name: arctic_rl`` resolve in verl: the replica (agent loop) and the worker-side rollout."""
    RolloutReplicaRegistry.register(NAME, lambda: ArcticRLReplica)
    verl_rollout_base._ROLLOUT_REGISTRY[(NAME, "async")] = "arctic_rl.integrations.verl.ArcticRLRollout"
