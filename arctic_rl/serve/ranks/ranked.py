"""``RankedCore``: the service over several training ranks (``training.devices x training.num_nodes > 1``), with the
methods and answers of the one-process ``ServiceCore``, so every transport (local, HTTP, Ray, Tinker) serves it
unchanged (:func:`make_core` picks one of the two).

It starts the ranks itself (``placement.py``): local rank processes (``training.launcher: processes``) or one Ray
actor per rank on a cluster (``launcher: ray``). Each serves ``worker.py``'s handler, that rank's ``ServiceCore``,
with the ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*`` variables Lightning reads, so each rank runs the one-process
machinery unchanged and they reduce as ``arctic-rl fit`` on as many devices does: DeepSpeed averages the ranks'
gradients, every loss is normalised by the counts over all ranks.

- One operation at a time, sent to every rank in the same order (collectives pair up).
- ``forward`` / ``forward_backward``: the batch is checked once here, then split by prompt groups
  (``split.py``); the answers are merged (outputs in batch order; losses summed, ...).
- ``optim_step``, ``zero_grad``, ``sync_weights``, ``save_state``, ``load_state``, ``export``: every rank (each
  writes or reads its own ZeRO shards; rank 0 gathers once and sends the weights once to its engine); rank 0's answer.
- ``sample``, ``sleep``, ``wake``, ``status``: rank 0, which owns the engine (or started the engine replicas, Ray
  actors beside the ranks); the other ranks take an empty step (``status``) with it, since each step of Lightning's
  loop is a collective. Rank 0's ``JobFailed`` (an engine replica died) ends the job.
- Errors: a request every rank refused (4xx) is that refusal; a timeout on every rank is ``ServiceTimeout``; any
  other mix (one rank failed while another answered or still runs, a rank process died) leaves the ranks out of
  step, so the job is ended and the call is ``JobFailed`` naming the rank (and its node, for a rank actor).
- ``close`` stops every rank (all asked at once, then each waited for and killed after a timeout; for rank actors,
  their placement group is removed too).
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any

from arctic_rl.serve.batch import AdamSettings, TrainBatch, learning_rate
from arctic_rl.serve.config import ArcticRLClientConfig
from arctic_rl.serve.core import PathOperations, SampleOutput, ServiceCore
from arctic_rl.serve.errors import JobFailed, ServiceError, ServiceTimeout
from arctic_rl.serve.idempotency import RecentRequests, digest_of, replayed
from arctic_rl.serve.ops import CoreHandler
from arctic_rl.serve.ranks.placement import Ranks
from arctic_rl.serve.ranks.split import merge_losses, merge_outputs, split_rows, take_rows
from arctic_rl.serve.transport import Message

SETTLE_S = 10.0  # after one rank failed: how long the others get to answer (a refusal on every rank is quick)
REPLY_MARGIN_S = 30.0  # beyond a call's timeout: the ranks' own timeout answers arrive in it


def make_core(config: ArcticRLClientConfig) -> ServiceCore | RankedCore:
    """The core a config describes: one rank in this process, or ranks behind one front (several, or any number as
    Ray actors: ``training.launcher: ray`` places even one rank on the cluster)."""
    t = config.training
    return ServiceCore(config) if t.world_size == 1 and t.launcher == "processes" else RankedCore(config)


def build_handler(config: Any) -> CoreHandler:
    """The default handler factory of ``arctic-rl serve`` and the Ray actor (``factory.DEFAULT_FACTORY``): a core for
    ``config`` (a dict, a YAML path or an ``ArcticRLClientConfig``; :func:`make_core`), started on its first request."""
    return CoreHandler(make_core(ArcticRLClientConfig.load(config)))


class RankedCore(PathOperations):
    """The job over ``training.devices x training.num_nodes`` ranks (see the module docstring). Each public method is
    ``ServiceCore``'s, with its arguments and answers; ``timeout_s`` None: ``timeouts.call_s``."""

    def __init__(self, config: ArcticRLClientConfig) -> None:
        self.config = config
        self.world_size = config.training.world_size
        self.ranks = make_ranks(config)
        self._started = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._rank0: dict[str, Any] = {}  # rank 0's first status (vocabulary size, end-of-sequence id)
        self._lifecycle = threading.Lock()
        self._order = threading.Lock()  # one operation at a time, in the same order on every rank
        self._recent = RecentRequests()
        self._failure: str | None = None
        self._closed = False

    @property
    def rank_pids(self) -> list[int]:
        """The rank processes' ids (empty before the first call)."""
        return self.ranks.pids

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the ranks and their training job (idempotent; the first operation calls it)."""
        with self._lifecycle:
            if self._failure is not None:
                raise JobFailed(self._failure)
            if self._closed:
                raise JobFailed("the training job is closed")
            if self._started:
                return
            self._started = True
            try:
                self._launch()
                timeouts = self.config.timeouts
                replies = self._fan_out("status", [Message()] * self.world_size, timeouts.startup_s + timeouts.call_s)
            except BaseException:
                self._stop_ranks()
                self.ranks, self._started = make_ranks(self.config), False  # a later call tries again
                raise
            self._rank0 = replies[0].meta

    def _launch(self) -> None:
        from arctic_rl.config_paths import resolve_paths

        # relative paths as this process sees them (a rank reads its config from a temporary file or runs elsewhere);
        # the ranks get tokens of their own, so the job's token is not passed on
        config = resolve_paths({**self.config.to_dict(include_secrets=True), "auth_token": None}, Path.cwd())
        config["server"] = {**config["server"], "host": "127.0.0.1", "port": 0}
        self._pool = concurrent.futures.ThreadPoolExecutor(self.world_size, thread_name_prefix="arctic-rl-rank")
        self.ranks.start(config)

    def close(self, timeout_s: float = 120.0, operation_grace_s: float = 5.0) -> None:
        """End the job: every rank is asked to stop at once (each closes its training loop, which ends
        with a barrier of all ranks), then each is waited for and killed after ``timeout_s``. Idempotent."""
        with self._lifecycle:
            if self._closed:
                return
            self._closed = True
            self._stop_ranks(timeout_s)

    def _stop_ranks(self, timeout_s: float = 120.0) -> None:
        self.ranks.stop(timeout_s)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _end(self, reason: str) -> JobFailed:
        """The job cannot go on (its ranks are out of step): stop the ranks; the error every later call gets."""
        self._failure = f"the training job was ended: {reason}"
        threading.Thread(target=self.close, name="arctic-rl-ranks-close", daemon=True).start()
        return JobFailed(self._failure)

    # ------------------------------------------------------------------ sending
    def _fan_out(self, op: str, requests: list[Message], timeout_s: float | None, alone: bool = False) -> list[Message]:
        """Send ``requests[r]`` to rank ``r`` and wait for every answer (module docstring). ``alone``: ``op`` is
        rank 0's only (no collective inside it); the other ranks get ``status``, a step that does nothing, since
        every training step of Lightning's loop is itself a collective (it broadcasts a stop signal): the ranks
        must take their steps together. Rank 0's error is then the call's, whatever it is."""
        timeout = self.config.timeouts.call_s if timeout_s is None else timeout_s
        if not self._order.acquire(timeout=timeout):
            raise ServiceTimeout(f"{op} did not start within {timeout:g}s (an earlier operation was still running)")
        try:
            futures = [self._pool.submit(self.ranks.call, r, op if r == 0 or not alone else "status", request, timeout)
                       for r, request in enumerate(requests)]
            done, pending = concurrent.futures.wait(futures, timeout + REPLY_MARGIN_S,
                                                    return_when=concurrent.futures.FIRST_EXCEPTION)
            if pending and any(f.exception() is not None for f in done):
                concurrent.futures.wait(pending, SETTLE_S)
        finally:
            self._order.release()
        errors = {r: f.exception() for r, f in enumerate(futures) if f.done() and f.exception() is not None}
        running = [r for r, f in enumerate(futures) if not f.done()]
        if not errors and not running:
            return [f.result() for f in futures]
        if alone and list(errors) == [0] and not running and not isinstance(errors[0], JobFailed):
            raise errors[0]
        if not running and len(errors) == len(futures):
            first = errors[0]
            if isinstance(first, ServiceError) and first.status < 500 and all(isinstance(e, type(first)) for e in errors.values()):
                raise first  # every rank refused it before doing anything: nothing changed
            if all(isinstance(e, ServiceTimeout) for e in errors.values()):
                raise first
        dead = self.ranks.dead(errors)
        if dead:
            rank, how = dead[0]
            others = sorted(set(errors) - {rank})
            raise self._end(f"training rank {rank}{self.ranks.where(rank)} died during {op} ({how})" + (
                f"; ranks {others} failed with it" if others else "")) from errors.get(rank)
        if alone and list(errors) == [0] and not running:  # rank 0's job ended (an engine replica died): so does every rank's
            raise self._end(f"{errors[0]} (on training rank 0{self.ranks.where(0)}, during {op})") from errors[0]
        if errors:
            rank = min(errors)
            raise self._end(f"training rank {rank}{self.ranks.where(rank)} failed during {op}: "
                            f"{type(errors[rank]).__name__}: {errors[rank]}"
                            + (f" (ranks {running} still running)" if running else "")) from errors[rank]
        raise self._end(f"training ranks {running} did not answer {op} within {timeout:g}s")

    def _all(self, op: str, meta: dict[str, Any] | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        """``op`` on every rank with the same ``meta``; rank 0's answer."""
        self.start()
        return self._fan_out(op, [Message(dict(meta or {}))] * self.world_size, timeout_s)[0].meta

    def _on_rank0(self, op: str, request: Message, timeout_s: float | None) -> Message:
        """``op`` on rank 0, which owns the engine; the other ranks take an empty step with it (``_fan_out``)."""
        self.start()
        return self._fan_out(op, [request] + [Message()] * (self.world_size - 1), timeout_s, alone=True)[0]

    def _batch_shares(self, batch: TrainBatch, meta: dict[str, Any]) -> list[Message]:
        """``batch`` checked as one rank would check it (before any rank starts, so a bad batch changes nothing),
        then each rank's share as a request with ``meta``."""
        self.start()
        checked = TrainBatch.from_message(batch.to_message())
        s = self.config.sampling
        checked.check_limits(self._rank0["vocab_size"], s.max_prompt_length, s.max_response_length)
        return [take_rows(checked, rows).to_message(meta) for rows in split_rows(checked.prompt_token_ids, self.world_size)]

    def _once(self, name: str, request_id: str | None, digest: str, run, timeout_s: float | None) -> Any:
        """``run()``, or with a ``request_id`` seen before, the first call's answer (``idempotency.py``)."""
        if request_id is None:
            return run()
        future: concurrent.futures.Future = concurrent.futures.Future()
        earlier = self._recent.claim(name, request_id, digest, future)
        if earlier is not None:
            try:
                return replayed(earlier.result(self.config.timeouts.call_s if timeout_s is None else timeout_s))
            except concurrent.futures.TimeoutError:
                raise ServiceTimeout(f"{name} (a retry of {request_id!r}) did not finish in time") from None
        future.set_running_or_notify_cancel()
        try:
            answer = run()
        except BaseException as e:
            future.set_exception(e)
            raise
        future.set_result(answer)
        return answer

    # ------------------------------------------------------------------ operations
    def sample(self, prompts: list[list[int]] | list[str], n: int = 1, max_tokens: int | None = None,
               temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
               prompt_seeds: list[int] | None = None, timeout_s: float | None = None,
               stop_token_ids: list[int] = (), max_staleness: int | None = None, listener: Any = None) -> SampleOutput:
        # ``listener`` is never called: rank 0 samples in its own process and answers whole (``Operations.sample``)
        self.bound_staleness(max_staleness, timeout_s)
        meta = {"prompts": list(prompts), "n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                "seed": seed, "prompt_seeds": prompt_seeds, "stop_token_ids": list(stop_token_ids)}
        return SampleOutput.from_message(self._on_rank0("sample", Message(meta), timeout_s))

    def forward(self, batch: TrainBatch, processors: list[str] = ("logprobs",), timeout_s: float | None = None):
        shares = self._batch_shares(batch, {"processors": list(processors)})
        return merge_outputs([reply.tensors for reply in self._fan_out("forward", shares, timeout_s)])

    def forward_backward(self, batch: TrainBatch, loss: str, loss_config: dict[str, Any] | None = None,
                         timeout_s: float | None = None, request_id: str | None = None,
                         processors: list[str] = ()) -> dict[str, Any]:
        meta = {"loss": loss, "loss_config": dict(loss_config or {})} | ({"processors": list(processors)} if processors else {})
        digest = "" if request_id is None else digest_of(batch.to_message(meta))

        def run() -> dict[str, Any]:
            replies = self._fan_out("forward_backward", self._batch_shares(batch, meta), timeout_s)
            merged = merge_losses([reply.meta for reply in replies])
            return {**merged, "outputs": merge_outputs([reply.tensors for reply in replies])} if processors else merged

        return self._once("forward_backward", request_id, digest, run, timeout_s)

    def optim_step(self, lr: float | None = None, timeout_s: float | None = None, request_id: str | None = None,
                   advance_schedule: bool = True, adam: AdamSettings | None = None) -> dict[str, float]:
        lr = learning_rate("lr", lr)  # refused here, before any rank works
        meta: dict[str, Any] = {"advance_schedule": advance_schedule} | ({} if lr is None else {"lr": lr})
        if adam is not None:
            meta["adam"] = {"beta1": adam.betas[0], "beta2": adam.betas[1], "eps": adam.eps,
                            "weight_decay": adam.weight_decay, "max_grad_norm": adam.max_grad_norm}
        digest = "" if request_id is None else digest_of(Message({**meta, "adam": repr(adam)}))
        out = self._once("optim_step", request_id, digest, lambda: self._all("optim_step", meta, timeout_s), timeout_s)
        self.weight_lag.stepped(out)
        return out

    def zero_grad(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self._all("zero_grad", timeout_s=timeout_s)

    def sync_weights(self, timeout_s: float | None = None) -> dict[str, float]:
        out = self._all("sync_weights", timeout_s=timeout_s)  # rank 0 sends; the others only gather with it
        self.weight_lag.synced()
        return out

    def sleep(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self._on_rank0("sleep", Message(), timeout_s).meta

    def wake(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self._on_rank0("wake", Message(), timeout_s).meta

    def _path_call(self, name: str, path: str, timeout_s: float | None) -> dict[str, Any]:
        """Check ``path`` once here (``targets.check_target``), before any rank touches the disk; then every rank."""
        from arctic_rl.serve.targets import check_target

        t = self.config.training
        check_target(self.config.server.root_dir, path, name, t.zero_stage, t.world_size, self.config.lora.rank)
        return self._all(name, {"path": path}, timeout_s)

    def status(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Rank 0's status (``world_size``: the ranks), the model as the config names it, ``rank_pids``,
        ``rank_nodes`` (each rank's Ray node id, or ``local``) and ``weights_behind`` (``lag.py``)."""
        reply = self._on_rank0("status", Message(), timeout_s).meta
        return {**reply, "model": self.config.model, "rank_pids": self.rank_pids, "rank_nodes": self.ranks.nodes,
                "weights_behind": self.weight_lag.behind}

    def eos_token_id(self) -> int | None:
        """The tokenizer's end-of-sequence id (starts the job)."""
        self.start()
        return self._rank0["eos_token_id"]


def make_ranks(config: ArcticRLClientConfig) -> Ranks:
    """The ranks ``training.launcher`` names."""
    if config.training.launcher == "ray":
        from arctic_rl.serve.ranks.actors import RayRanks

        return RayRanks(config)
    from arctic_rl.serve.ranks.processes import ProcessRanks

    return ProcessRanks(config)
