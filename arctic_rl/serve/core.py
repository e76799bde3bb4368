"""``ServiceCore``: the service's one training job. A real Lightning run (``Trainer.fit`` of a
``ServiceModule``, with ArcticStrategy for ZeRO) in its own thread, whose batches are the requests; the
core's plain methods, one per operation, queue a request and wait for its answer within a timeout.

It is started on the first call (model build, engines) and ended by :meth:`close`. One per process:
the run owns torch.distributed's default group."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset

from arctic_rl.rollout.engines.base import Completion, DecodeListener, SamplingConfig
from arctic_rl.serve.batch import AdamSettings, TrainBatch, learning_rate, split_by_counts
from arctic_rl.serve.config import ArcticRLClientConfig, ServerConfig
from arctic_rl.serve.errors import JobFailed, RequestError, ServiceTimeout
from arctic_rl.serve.idempotency import RecentRequests, digest_of, replayed
from arctic_rl.serve.lag import WeightLag, check_max_staleness
from arctic_rl.serve.operations import Operations
from arctic_rl.serve.transport import Message

_ACTIVE: list["ServiceCore"] = []  # the process's running core (at most one)
OPERATION_GRACE_S = 5.0  # on close (SIGTERM): how long an operation still running may take to finish


@dataclass
class SampleOutput:
    """``sample``'s answer, ``[num_prompts][n]`` each."""

    prompt_token_ids: list[list[int]]  # [num_prompts]: as given, or as the server tokenized text prompts
    completions: list[list[Completion]]
    texts: list[list[str]]  # decoded, special tokens removed

    def to_message(self) -> Message:
        """The wire reply (``ops.py``'s ``sample``): tensors ``token_ids``, ``logprobs``, ``lengths`` (flat,
        prompt-major), ``prompt_ids``, ``prompt_lengths``, and ``weight_versions`` (flat, when every completion knows
        its version); meta ``text`` and ``finish_reason`` ``[[str]]``."""
        import torch

        flat = [c for per_prompt in self.completions for c in per_prompt]
        tensors = {
            "token_ids": torch.tensor([t for c in flat for t in c.token_ids], dtype=torch.long),
            "logprobs": torch.tensor([lp for c in flat for lp in c.logprobs], dtype=torch.float32),
            "lengths": torch.tensor([len(c.token_ids) for c in flat], dtype=torch.long),
            "prompt_ids": torch.tensor([t for p in self.prompt_token_ids for t in p], dtype=torch.long),
            "prompt_lengths": torch.tensor([len(p) for p in self.prompt_token_ids], dtype=torch.long),
        }
        if all(c.weight_version is not None for c in flat):
            tensors["weight_versions"] = torch.tensor([c.weight_version for c in flat], dtype=torch.long)
        return Message({"text": self.texts, "finish_reason": [[c.finish_reason for c in per] for per in self.completions]}, tensors)

    @classmethod
    def from_message(cls, message: Message) -> "SampleOutput":
        """The inverse of :meth:`to_message` (a reply of the service's own, e.g. a training rank's)."""
        t, meta = message.tensors, message.meta
        lengths = t["lengths"].tolist()
        token_ids, logprobs = split_by_counts(t["token_ids"].tolist(), lengths), split_by_counts(t["logprobs"].tolist(), lengths)
        versions = t["weight_versions"].tolist() if "weight_versions" in t else [None] * len(lengths)
        flat = [Completion(ids, lps, reason, weight_version=version) for ids, lps, reason, version in
                zip(token_ids, logprobs, [r for per in meta["finish_reason"] for r in per], versions)]
        return cls(split_by_counts(t["prompt_ids"].tolist(), t["prompt_lengths"].tolist()),
                   split_by_counts(flat, [len(per) for per in meta["text"]]), meta["text"])


class _Requests(IterableDataset):
    """The training loop's data: an endless stream of queued commands; ``None`` ends it."""

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()

    def __iter__(self):
        while (command := self.queue.get()) is not None:
            yield command


def _as_is(item):  # the DataLoader's collate: commands pass through untouched
    return item


def build_module(config: ArcticRLClientConfig):
    """The ``ServiceModule`` a config describes: its model, and GRPOModule's option sections as the config sets them."""
    from arctic_rl.serve.service_module import ServiceModule

    t = config.training
    return ServiceModule(colocated=config.engines.colocated, reference_model=t.reference_model, total_steps=t.total_steps,
                         model=config.model, tokenizer=config.tokenizer, dtype=config.dtype, **config.module_options())


def build_trainer(config: ArcticRLClientConfig, engines):
    """A Lightning Trainer for the service: ArcticStrategy (DeepSpeed ZeRO) for ``zero_stage`` 1-3, no
    logger, no progress bar, no checkpoint callback (``save_state`` is explicit), one endless epoch."""
    import lightning.pytorch as pl

    t = config.training
    strategy: Any = "auto"
    if t.zero_stage:
        from arctic_rl.strategies import ArcticStrategy

        # requests have no batch size for Lightning to read off the DataLoader; DeepSpeed only logs this one
        raw = {"train_micro_batch_size_per_gpu": 1, **(t.deepspeed_config or {})}
        strategy = ArcticStrategy(stage=t.zero_stage, offload_optimizer=t.offload_optimizer, config=raw)
    return pl.Trainer(
        accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=strategy, precision=t.precision,
        max_epochs=1, max_steps=-1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[engines], default_root_dir=config.server.root_dir,
    )


def build_engines(config: ArcticRLClientConfig):
    """RolloutCallback's engines: one in-process engine, or a pool of Ray actors (``engines.launcher``) on the cluster
    at ``ray.address``, laid out by ``ray.placement_strategy`` as the rank actors are; colocated with rank actors
    (``training.launcher: ray``), replica i goes into rank i's placement bundle."""
    from arctic_rl.rollout.callback import RayEngines
    from arctic_rl.serve.service_module import ServiceEngines

    e = config.engines
    ray = None
    if e.on_ray:
        ray = RayEngines(address=config.ray.address, num_engines=e.num_engines, num_cpus_per_engine=e.num_cpus_per_engine,
                         num_gpus_per_engine=e.num_gpus_per_engine, placement_strategy=config.ray.placement_strategy,
                         timeout_s=config.timeouts.startup_s)
    return ServiceEngines(engine=e.engine, engine_kwargs=e.engine_kwargs, ray=ray, in_rank_bundles=config.replicas_in_rank_bundles)


def check_sample_size(server: ServerConfig, prompt_lengths: list[int], n: int, max_tokens: int, asked: str) -> None:
    """Refuse a sample request over the server's limits (``server.max_samples_per_request``, and
    ``max_sample_tokens_per_request``: completions x (prompt + max_tokens)) before anything is allocated;
    ``asked`` names the request's fields as its API spells them (``n=.. x .. prompts``, ``num_samples=..``)."""
    samples = n * len(prompt_lengths)
    if samples > server.max_samples_per_request:
        raise RequestError(f"{asked}: {samples} completions, over server.max_samples_per_request="
                           f"{server.max_samples_per_request}; ask for fewer per request")
    tokens = n * sum(length + max_tokens for length in prompt_lengths)
    if tokens > server.max_sample_tokens_per_request:
        raise RequestError(f"{asked} with max_tokens={max_tokens}: {tokens} tokens (completions x (prompt + max_tokens)), over "
                           f"server.max_sample_tokens_per_request={server.max_sample_tokens_per_request}; ask for fewer "
                           "completions or tokens per request")


class PathOperations(Operations, abstract=True):
    """The operations on a path under ``server.root_dir`` (``save_state``, ``load_state``, ``export``), shared by the
    one-process core and the multi-rank front (``ranks/ranked.py``): each goes through the core's own ``_path_call``."""

    @abstractmethod
    def _path_call(self, name: str, path: str, timeout_s: float | None) -> dict[str, Any]:
        """Check ``path`` and run the path operation ``name`` on it."""

    def save_state(self, path: str, timeout_s: float | None = None) -> dict[str, Any]:
        return self._path_call("save_state", path, timeout_s)

    def load_state(self, path: str, timeout_s: float | None = None) -> dict[str, Any]:
        out = self._path_call("load_state", path, timeout_s)
        self.weight_lag.synced()  # load_state pushes the restored weights to the engines
        return out

    @property
    def weight_lag(self) -> WeightLag:
        """How many optimizer steps the engines are behind the trainer (``lag.py``), as this front has seen the calls."""
        if "_weight_lag" not in vars(self):
            self._weight_lag = WeightLag()
        return self._weight_lag

    def bound_staleness(self, max_staleness: int | None, timeout_s: float | None) -> None:
        """``sample``'s ``max_staleness``: push the weights first when the engines are further behind than it."""
        check_max_staleness(max_staleness)
        if self.weight_lag.needs_sync(max_staleness):
            self.sync_weights(timeout_s)

    def export(self, path: str, timeout_s: float | None = None) -> dict[str, Any]:
        return self._path_call("export", path, timeout_s)


class ServiceCore(PathOperations):
    """The job. Each public method is one operation (``timeout_s`` None: ``timeouts.call_s``)."""

    def __init__(self, config: ArcticRLClientConfig) -> None:
        self.config = config
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._start_lock = threading.Lock()
        self._recent = RecentRequests()  # answers of requests that carried a request_id, for their retries
        self._pending: list[tuple[str, concurrent.futures.Future]] = []  # operations queued or running
        self._pending_lock = threading.Lock()  # callers on several threads (a producer beside a trainer) add to it

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Build the model, the optimizer and the engines (idempotent; the first operation calls it)."""
        with self._start_lock:
            if self._thread is not None:
                return self._raise_if_failed()
            if self._closed:
                raise JobFailed("the training job is closed")
            if _ACTIVE:
                raise JobFailed("a training job already runs in this process; close its client first")
            from torch.utils.data import DataLoader

            from arctic_rl.serve.registry import load_plugins

            load_plugins()  # user losses and processors from the arctic_rl.losses / arctic_rl.processors entry points
            self.module = build_module(self.config)
            self.engines = build_engines(self.config)
            self.module.engines = self.engines
            self.trainer = build_trainer(self.config, self.engines)
            self._requests = _Requests()
            loader = DataLoader(self._requests, batch_size=None, collate_fn=_as_is)
            self._thread = threading.Thread(target=self._run, args=(loader,), name="arctic-rl-training-core", daemon=True)
            _ACTIVE.append(self)
            self._thread.start()
            if not self.module.on_ready.wait(self.config.timeouts.startup_s):
                raise ServiceTimeout(f"the training job did not start within timeouts.startup_s={self.config.timeouts.startup_s:g}s")
            self._raise_if_failed()

    @property
    def started(self) -> bool:
        """Whether the model has been built (the first operation, or :meth:`start`)."""
        return self._thread is not None

    def configure_lora(self, rank: int) -> None:
        """Before :meth:`start`: train LoRA adapters of ``rank`` (the config's ``lora`` section, its other fields
        kept; 0: every weight). A front door whose clients choose the rank (Tinker's ``create_lora_training_client``)
        calls it; once the model is built its rank is fixed (``JobFailed``)."""
        with self._start_lock:
            if self._thread is not None:
                raise JobFailed(f"the model is built (lora.rank={self.config.lora.rank}); its LoRA rank cannot change")
            self.config = ArcticRLClientConfig.load(self.config, lora={"rank": rank} if rank else {"rank": 0, "alpha": None,
                                                                                                    "target_modules": None})

    def _run(self, loader) -> None:
        import lightning.pytorch as pl

        try:
            pl.seed_everything(self.config.sampling.seed, verbose=False)
            self.trainer.fit(self.module, train_dataloaders=loader)
        except BaseException as e:  # noqa: BLE001  (reported to every caller)
            self._failure = e
        finally:
            self.module.on_ready.set()
            if self in _ACTIVE:
                _ACTIVE.remove(self)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise JobFailed(f"the training job failed: {type(self._failure).__name__}: {self._failure}") from self._failure
        if self._thread is not None and not self._thread.is_alive():
            raise JobFailed("the training job has ended")

    def call(self, name: str, timeout_s: float | None = None, request_id: str | None = None, digest: str = "",
             **kwargs: Any) -> Any:
        """Run operation ``name`` in the training loop and return its answer. With a ``request_id`` (and the
        request's ``digest``), a retry of a remembered request gets its answer instead (``idempotency.py``)."""
        from arctic_rl.serve.service_module import Command

        self.start()
        timeout = self.config.timeouts.call_s if timeout_s is None else timeout_s
        command = Command(name, kwargs)
        earlier = None if request_id is None else self._recent.claim(name, request_id, digest, command.future)
        future = command.future if earlier is None else earlier
        if earlier is None:
            with self._pending_lock:
                self._pending = [(n, f) for n, f in self._pending if not f.done()] + [(name, future)]
                self._requests.queue.put(command)
        deadline = time.monotonic() + timeout
        while True:
            try:
                answer = future.result(timeout=min(0.5, max(deadline - time.monotonic(), 0.0)))
                return answer if earlier is None else replayed(answer)
            except concurrent.futures.CancelledError:
                raise JobFailed(f"the training job was closed before {name} started") from None
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():
                    self._raise_if_failed()
                if time.monotonic() >= deadline:
                    started = not future.cancel()  # not started yet: it never will
                    raise ServiceTimeout(f"{name} did not finish within {timeout:g}s"
                                         + (" (it is still running; the job's state will include it)" if started else "")) from None

    def close(self, timeout_s: float = 120.0, operation_grace_s: float = OPERATION_GRACE_S) -> None:
        """End the loop (engines shut down with it). Idempotent. Queued operations are cancelled; one still
        running gets ``operation_grace_s`` to finish, then the job stops waiting for it.

        Raises:
            ServiceTimeout: an operation was still running after ``operation_grace_s`` (it is abandoned: its
                result is lost and its thread is left to the process's exit), or the loop did not end within
                ``timeout_s``.
        """
        with self._start_lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is None:
                return
            with self._pending_lock:
                pending = list(self._pending)
            running = [(name, future) for name, future in pending if not future.cancel() and not future.done()]
            self._requests.queue.put(None)
            try:
                if running:
                    concurrent.futures.wait([future for _, future in running], operation_grace_s)
                    late = [name for name, future in running if not future.done()]
                    if late:
                        raise ServiceTimeout(f"{late[0]!r} was still running {operation_grace_s:g} s after the job was asked "
                                             "to close; stopped waiting for it (its result is lost)")
                self._thread.join(timeout_s)
                if self._thread.is_alive():
                    raise ServiceTimeout(f"the training job did not shut down within {timeout_s:g} s; stopped waiting for it")
            finally:
                if self in _ACTIVE:
                    _ACTIVE.remove(self)

    # ------------------------------------------------------------------ operations
    def sample(self, prompts: list[list[int]] | list[str], n: int = 1, max_tokens: int | None = None,
               temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
               prompt_seeds: list[int] | None = None, timeout_s: float | None = None,
               stop_token_ids: list[int] = (), max_staleness: int | None = None,
               listener: DecodeListener | None = None) -> SampleOutput:
        """``n`` completions of each prompt (token ids, or text tokenized without a template); a completion ends
        at end-of-sequence, at one of ``stop_token_ids`` (kept) or after ``max_tokens``. ``listener``: told each
        decode step's tokens, in the training loop's thread, by an engine in this process that ``StreamsTokens``."""
        self.start()
        tokenizer = self.module.tokenizer
        ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if not ids:
            raise RequestError("prompts must not be empty")
        if prompt_seeds is not None and len(prompt_seeds) != len(ids):
            raise RequestError(f"prompt_seeds has {len(prompt_seeds)} seeds for {len(ids)} prompts")
        if n < 1:
            raise RequestError(f"n must be >= 1, got {n}")
        if max_tokens is not None and max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1 (or null: sampling.max_response_length), got {max_tokens}")
        if not temperature >= 0:
            raise RequestError(f"temperature must be >= 0 (0: greedy), got {temperature}")
        if not 0 < top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {top_p}")
        max_tokens = self.config.sampling.max_response_length if max_tokens is None else max_tokens
        check_sample_size(self.config.server, [len(p) for p in ids], n, max_tokens, f"n={n} x {len(ids)} prompts")
        sampling = SamplingConfig(n=n, max_tokens=max_tokens,
                                  temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=tuple(stop_token_ids),
                                  prompt_seeds=None if prompt_seeds is None else tuple(prompt_seeds))
        self.bound_staleness(max_staleness, timeout_s)
        completions = self.call("sample", timeout_s, prompt_token_ids=ids, sampling=sampling, listener=listener)
        texts = [tokenizer.batch_decode([c.token_ids for c in per_prompt], skip_special_tokens=True) for per_prompt in completions]
        return SampleOutput(ids, completions, texts)

    def forward(self, batch: TrainBatch, processors: list[str] = ("logprobs",), timeout_s: float | None = None):
        return self.call("forward", timeout_s, batch=batch, processors=list(processors))

    def forward_backward(self, batch: TrainBatch, loss: str, loss_config: dict[str, Any] | None = None,
                         timeout_s: float | None = None, request_id: str | None = None,
                         processors: list[str] = ()) -> dict[str, Any]:
        loss_config, processors = dict(loss_config or {}), list(processors)
        meta = {"loss": loss, "loss_config": loss_config} | ({"processors": processors} if processors else {})
        digest = "" if request_id is None else digest_of(batch.to_message(meta))
        return self.call("forward_backward", timeout_s, request_id, digest, batch=batch, loss=loss, loss_config=loss_config,
                         processors=processors)

    def optim_step(self, lr: float | None = None, timeout_s: float | None = None,
                   request_id: str | None = None, advance_schedule: bool = True,
                   adam: AdamSettings | None = None) -> dict[str, float]:
        """Clip, step, zero the gradients; ``adam``: this step's other AdamW settings (None: as they are). ``lr``
        (None: the schedule's) must be finite and > 0. A non-finite gradient's step is skipped: ``step_skipped``."""
        lr = learning_rate("lr", lr)
        meta = {"lr": lr, "advance_schedule": advance_schedule, "adam": None if adam is None else repr(adam)}
        digest = "" if request_id is None else digest_of(Message(meta))
        out = self.call("optim_step", timeout_s, request_id, digest, lr=lr, advance_schedule=advance_schedule, adam=adam)
        self.weight_lag.stepped(out)
        return out

    def zero_grad(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self.call("zero_grad", timeout_s)

    def sync_weights(self, timeout_s: float | None = None) -> dict[str, float]:
        out = self.call("sync_weights", timeout_s)
        self.weight_lag.synced()
        return out

    def sleep(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self.call("sleep", timeout_s)

    def wake(self, timeout_s: float | None = None) -> dict[str, Any]:
        return self.call("wake", timeout_s)

    def _path_call(self, name: str, path: str, timeout_s: float | None) -> dict[str, Any]:
        """Check ``path`` (``targets.check_target``: the one place, before any file is touched), then run ``name``."""
        from arctic_rl.serve.targets import check_target

        t = self.config.training
        target = check_target(self.config.server.root_dir, path, name, t.zero_stage, t.world_size, self.config.lora.rank)
        return self.call(name, timeout_s, path=target, shown=path)

    def status(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The job's step, learning rate, model (as the server's config names it), sizes, process id, and how many
        optimizer steps the engines' weights are behind (``weights_behind``)."""
        return {**self.call("status", timeout_s), "model": self.config.model, "weights_behind": self.weight_lag.behind}

    def eos_token_id(self) -> int | None:
        """The tokenizer's end-of-sequence id (starts the job)."""
        self.start()
        return self.module.tokenizer.eos_token_id
