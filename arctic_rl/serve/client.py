"""``ArcticRLClient``: drive arctic-rl's training core from another RL loop, in-process (``local``), over
HTTP or through Ray. The same methods and answers on every protocol; the first call starts the job.

    from arctic_rl.serve import ArcticRLClient, TrainBatch

    with ArcticRLClient(model="Qwen/Qwen3-1.7B", protocol="http") as client:
        out = client.sample(prompts, n=8, max_tokens=256)
        ...                                    # rewards and advantages: yours
        client.forward_backward(out.train_batch(advantages), "dapo")
        client.optim_step()
        client.sync_weights()
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass
from typing import Any

import torch

from arctic_rl.serve.batch import TrainBatch, split_by_counts
from arctic_rl.serve.operations import Operations
from arctic_rl.serve.transport import Handler, Message


@dataclass
class Samples:
    """``sample``'s answer: ``[num_prompts][n]`` each."""

    prompt_token_ids: list[list[int]]  # [num_prompts]: as sent, or as the server tokenized text prompts
    token_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]  # the sampler's log-prob of each token
    text: list[list[str]]
    finish_reason: list[list[str]]  # "stop" or "length"
    # the weight version each completion was sampled with: 0 the start-up weights, n after the n-th sync_weights
    # (None: a server that does not report it)
    weight_versions: list[list[int]] | None = None

    def flat_token_ids(self) -> list[list[int]]:
        """Every completion, prompt-major (the G samples of a prompt contiguous): a TrainBatch's responses."""
        return [ids for per_prompt in self.token_ids for ids in per_prompt]

    def flat_logprobs(self) -> list[list[float]]:
        return [lps for per_prompt in self.logprobs for lps in per_prompt]

    def train_batch(self, advantages, **optional) -> TrainBatch:
        """The completions as a ``TrainBatch`` (each prompt's samples contiguous, the sampler's log-probs
        attached); ``advantages`` ``[num_prompts * n]`` in the same order as :meth:`flat_token_ids`."""
        prompts = [p for p, per_prompt in zip(self.prompt_token_ids, self.token_ids) for _ in per_prompt]
        return TrainBatch.build(prompts, self.flat_token_ids(), advantages, sampler_logprobs=self.flat_logprobs(), **optional)


class ArcticRLClient(Operations):
    """One training job, driven call by call.

    Args:
        config: an ``ArcticRLClientConfig``, a dict or a YAML path (``None``: keywords only).
        overrides: config fields as keywords (``model=...``, ``protocol="http"``, ``training={...}``).
    """

    def __init__(self, config: Any = None, **overrides: Any) -> None:
        from arctic_rl.serve.config import ArcticRLClientConfig

        self.config = ArcticRLClientConfig.load(config, **overrides)
        self._transport: Handler | None = None
        self._server = None  # an embedded HTTP server this client started
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    # ------------------------------------------------------------------ lifecycle
    def _connect(self) -> Handler:
        with self._lock:
            if self._closed:
                raise RuntimeError("this ArcticRLClient is closed")
            if self._transport is None:
                self._transport = self._open_transport()
            return self._transport

    def _config_for_another_process(self) -> dict:
        """The config as a dict whose relative paths are made absolute against this process's working
        directory: a server reads it from a temporary file, a Ray actor may run elsewhere."""
        from pathlib import Path

        from arctic_rl.config_paths import resolve_paths

        return resolve_paths(self.config.to_dict(include_secrets=True), Path.cwd())

    def _open_transport(self) -> Handler:
        cfg, timeouts = self.config, self.config.timeouts
        if cfg.protocol == "local":
            from arctic_rl.serve.ops import CoreHandler
            from arctic_rl.serve.ranks.ranked import make_core

            return CoreHandler(make_core(cfg))
        if cfg.protocol == "http":
            from arctic_rl.serve.transports.http_client import HttpTransport

            url, token = cfg.server_url, cfg.auth_token
            if url is None:  # the embedded default: a server of our own on loopback (a fresh token), stopped on close
                from arctic_rl.serve.transports.process import start_server_process

                self._server = start_server_process(self._config_for_another_process(), token=token,
                                                    startup_timeout_s=timeouts.startup_s,
                                                    max_request_bytes=int(cfg.server.max_request_mb * 2**20))
                url, token = self._server.url, self._server.token
            transport = HttpTransport(url, auth_token=token, connect_timeout_s=timeouts.connect_s,
                                      call_timeout_s=timeouts.call_s)
            if self._server is None and cfg.model is not None:
                self._check_the_servers_model(transport)
            return transport
        from arctic_rl.serve.transports.ray_actor import RayTransport

        return RayTransport(self._config_for_another_process(), ray_address=cfg.ray.address,
                            call_timeout_s=timeouts.call_s, startup_timeout_s=timeouts.startup_s)

    def _check_the_servers_model(self, transport: Handler) -> None:
        """A running server owns its model: a client config naming another one is a mistake (``ConfigError``).
        Paths are compared as this process sees them (the server's is absolute)."""
        from pathlib import Path

        from arctic_rl.errors import ConfigError

        mine = self._config_for_another_process()["model"]
        timeout_s = self.config.timeouts.startup_s + self.config.timeouts.call_s  # the first call starts the job
        theirs = transport.call("status", Message(), timeout_s).meta["model"]
        same = mine == theirs or (isinstance(mine, str) and isinstance(theirs, str) and Path(mine).exists()
                                  and Path(mine).resolve() == Path(theirs).resolve())
        if not same:
            transport.close()
            raise ConfigError(f"model: the client config names {mine!r}, but the server at {self.config.server_url} "
                              f"trains {theirs!r}; leave model out (the server owns it) or name the server's")

    def _call(self, op: str, meta: dict | None = None, tensors: dict | None = None, timeout_s: float | None = None,
              message: Message | None = None) -> Message:
        request = message if message is not None else Message(dict(meta or {}), dict(tensors or {}))
        if timeout_s is None and self._transport is None:
            timeout_s = self.config.timeouts.startup_s + self.config.timeouts.call_s  # the first call starts the job
        return self._connect().call(op, request, timeout_s)

    def close(self) -> None:
        """End the job: the core, its engines and an embedded server (idempotent; also at exit)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            transport, server = self._transport, self._server
            self._transport = self._server = None
        try:
            if transport is not None:
                transport.close()
        finally:
            if server is not None:
                server.stop()
            atexit.unregister(self.close)

    def __enter__(self) -> "ArcticRLClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ operations
    def sample(self, prompts: list[list[int]] | list[str], n: int = 1, max_tokens: int | None = None,
               temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
               prompt_seeds: list[int] | None = None, timeout_s: float | None = None,
               stop_token_ids: list[int] = (), max_staleness: int | None = None, listener: Any = None) -> Samples:
        """``n`` completions of each prompt (token ids, or strings tokenized as they are). Seeds: each sample
        of prompt ``i`` draws from its own stream derived from ``prompt_seeds[i]`` (or ``seed`` and ``i``).
        A completion also ends at one of ``stop_token_ids`` (kept). ``max_staleness``: push the trainer's weights
        first when the engines are more than this many optimizer steps behind (None: as they are). ``listener`` is never
        called: the server answers whole (``Operations.sample``)."""
        meta = {"prompts": prompts, "n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                "seed": seed, "prompt_seeds": prompt_seeds} | ({"stop_token_ids": list(stop_token_ids)} if stop_token_ids else {})
        if max_staleness is not None:
            meta["max_staleness"] = max_staleness
        reply = self._call("sample", meta, timeout_s=timeout_s)
        lengths = reply.tensors["lengths"].tolist()
        token_ids = split_by_counts(reply.tensors["token_ids"].tolist(), lengths)
        logprobs = split_by_counts(reply.tensors["logprobs"].tolist(), lengths)
        per_prompt = [len(row) for row in reply.meta["text"]]
        prompt_ids = split_by_counts(reply.tensors["prompt_ids"].tolist(), reply.tensors["prompt_lengths"].tolist())
        versions = reply.tensors.get("weight_versions")
        return Samples(prompt_ids, split_by_counts(token_ids, per_prompt), split_by_counts(logprobs, per_prompt),
                       reply.meta["text"], reply.meta["finish_reason"],
                       None if versions is None else split_by_counts(versions.tolist(), per_prompt))

    def forward(self, batch: TrainBatch, processors: list[str] = ("logprobs",), timeout_s: float | None = None) -> dict[str, torch.Tensor]:
        """Per-token outputs of the registered ``processors`` (``logprobs``, ``entropy``, ``ref_logprobs``, yours)."""
        return self._call("forward", timeout_s=timeout_s, message=batch.to_message({"processors": list(processors)})).tensors

    def forward_backward(self, batch: TrainBatch, loss: str = "dapo", loss_config: dict[str, Any] | None = None,
                         timeout_s: float | None = None, request_id: str | None = None,
                         processors: list[str] = ()) -> dict[str, Any]:
        """Loss ``loss`` (a registered name) of ``batch``; gradients accumulate until ``optim_step``.

        ``request_id``: makes a retry safe. Send the same id again (after a timeout or a dropped connection) and
        the server answers with the first call's result, ``replayed: True``, without accumulating twice; an id
        reused for another batch is refused. None: every call runs.
        ``processors``: as ``forward``'s, run on the loss's own forward (no second pass); their tensors come back
        under ``outputs``."""
        meta = ({"loss": loss, "loss_config": dict(loss_config or {})} | ({"request_id": request_id} if request_id else {})
                | ({"processors": list(processors)} if processors else {}))
        reply = self._call("forward_backward", timeout_s=timeout_s, message=batch.to_message(meta))
        return {**reply.meta, "outputs": reply.tensors} if processors else reply.meta

    def optim_step(self, lr: float | None = None, timeout_s: float | None = None,
                   request_id: str | None = None, advance_schedule: bool = True,
                   adam: dict[str, float] | None = None) -> dict[str, float]:
        """Clip, step the optimizer (``lr``: this step's rate; None: the schedule's), zero the gradients.
        ``advance_schedule=False``: the learning-rate schedule stays where it is, so the next step gets the same
        rate (verl advances its schedule once per training step, after its last mini-batch). ``adam``: this
        step's other AdamW settings, all of ``beta1``, ``beta2``, ``eps``, ``weight_decay`` and ``max_grad_norm``
        (the clipping threshold, 0: none); they stay until a later step sets others (``training.zero_stage: 0``).
        Returns ``grad_norm`` (before clipping), ``lr`` and ``step``. ``request_id``: as for ``forward_backward``."""
        meta = ({"lr": lr} if lr is not None else {}) | ({"request_id": request_id} if request_id else {})
        meta |= ({} if advance_schedule else {"advance_schedule": False}) | ({} if adam is None else {"adam": dict(adam)})
        return self._call("optim_step", meta, timeout_s=timeout_s).meta

    def zero_grad(self, timeout_s: float | None = None) -> dict:
        return self._call("zero_grad", timeout_s=timeout_s).meta

    def sync_weights(self, timeout_s: float | None = None) -> dict[str, float]:
        """Push the policy's weights into the sampling engines."""
        return self._call("sync_weights", timeout_s=timeout_s).meta

    def sleep(self, timeout_s: float | None = None) -> dict:
        """Free the engines' accelerator memory (colocated engines; a no-op on CPU)."""
        return self._call("sleep", timeout_s=timeout_s).meta

    def wake(self, timeout_s: float | None = None) -> dict:
        return self._call("wake", timeout_s=timeout_s).meta

    def save_state(self, path: str, timeout_s: float | None = None) -> dict:
        """Weights, optimizer, schedule and step, for an exact ``load_state`` (``path`` under ``server.root_dir``)."""
        return self._call("save_state", {"path": path}, timeout_s=timeout_s).meta

    def load_state(self, path: str, timeout_s: float | None = None) -> dict:
        """Restore a ``save_state`` and push the restored weights to the engines."""
        return self._call("load_state", {"path": path}, timeout_s=timeout_s).meta

    def export(self, path: str, timeout_s: float | None = None) -> dict:
        """Write the policy as a ``save_pretrained`` directory (vLLM serves it) under ``server.root_dir``."""
        return self._call("export", {"path": path}, timeout_s=timeout_s).meta

    def status(self, timeout_s: float | None = None) -> dict:
        return self._call("status", timeout_s=timeout_s).meta
