"""``TinkerService``: the Tinker API's operations over one ``ServiceCore`` (``arctic-rl serve --api tinker``).

The Tinker SDK answers most calls with a future (a request id) and fetches the result later
(``/api/v1/retrieve_future``). Here a future is a ``concurrent.futures.Future`` in a dict by request id; the
operations run one at a time in a worker thread (``queue.OperationQueue``), in the order they arrived (the
SDK sends a training client's requests in its own order), each translated into calls of the core's plain
methods; consecutive ``sample`` requests with the same settings run as one engine call. What the core cannot
do exactly is refused with the reason, as the SDK's ``{"error", "category"}``.

Sampler weights: ``save_weights_for_sampler`` writes the policy (``export``) and pushes it into the engines
(``sync_weights``), so the engines hold the newest sampler weights; a sampling session may sample only the
weights the engines hold (the base model's, until the first push), and is refused otherwise.
"""

from __future__ import annotations

import itertools
import math
import re
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from arctic_rl.errors import ConfigError
from arctic_rl.rollout.engines.seeds import mix_seed
from arctic_rl.serve.tinker import losses as tinker_losses, wire as tinker_wire
from arctic_rl.serve.batch import AdamSettings
from arctic_rl.serve.core import ServiceCore, check_sample_size
from arctic_rl.serve.ranks.ranked import RankedCore
from arctic_rl.serve.errors import RequestError, ServiceError
from arctic_rl.serve.tinker.batch import (TinkerInputError, check_vocabulary, forward_batch, target_logprobs, target_sources,
                                         train_batch)
from arctic_rl.serve.tinker.queue import Job, OperationQueue

BASE = "base"  # what the engines hold before the first save_weights_for_sampler
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # what a create_model's session_id may be
MAX_FUTURES = 4096  # answered futures kept for the SDK's retries of retrieve_future (oldest dropped first)


class TinkerRefusal(RequestError):
    """A Tinker request arctic-rl does not serve; the message names what and why."""


def error_body(error: BaseException) -> dict[str, str]:
    """The SDK's ``RequestFailedResponse``: ``user`` for a refused request, ``server`` for the rest."""
    user = isinstance(error, (TinkerInputError, RequestError)) or (isinstance(error, ServiceError) and error.status < 500)
    return {"error": f"{type(error).__name__}: {error}", "category": "user" if user else "server"}


class TinkerService:
    """The Tinker API's state (sessions, the one training model, sampling sessions, futures) over ``core``."""

    def __init__(self, core: ServiceCore | RankedCore) -> None:
        self.core = core
        config = core.config
        self.model_name = config.model if isinstance(config.model, str) else f"arctic-rl/{config.model.get('model_type', 'model')}"
        self.tokenizer_id = config.tokenizer or (config.model if isinstance(config.model, str) else None)
        self.model_id: str | None = None
        self.engines_hold = BASE  # the sampler path whose weights the engines hold (None: loaded state, not a sampler path)
        self.sampling_sessions: dict[str, str] = {}  # id -> the sampler path (or BASE) it samples
        self.futures: OrderedDict[str, Future] = OrderedDict()
        self.vocab_size: int | None = None  # the model's, read once its job runs
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._queue = OperationQueue()

    # ------------------------------------------------------------------ futures
    def submit(self, operation: Callable[[], Any], model_id: str | None = None, **extra: Any) -> dict[str, Any]:
        """Queue ``operation`` behind the earlier ones; the SDK's ``UntypedAPIFuture`` for it."""
        return self._enqueue(Job(run=operation), model_id, **extra)

    def submit_sample(self, request: dict[str, Any]) -> dict[str, Any]:
        """Queue a ``sample`` request; consecutive ones with the same settings run as one engine call."""
        n, settings = request.get("num_samples", 1), request.get("sampling_params") or {}
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or not isinstance(settings, dict):
            raise TinkerInputError(f"sample: num_samples must be an integer >= 1 and sampling_params an object, got "
                                   f"{n!r} and {type(settings).__name__}")
        self.check_sample_size(request, n)
        params = {k: v for k, v in settings.items() if k != "seed"}
        key = ("sample", request.get("sampling_session_id"), request.get("model_path"), n, repr(sorted(params.items())),
               settings.get("seed") is None)
        answer = self._enqueue(Job(key=key, batch=self.sample_batch, item=request))
        return {**answer, "sample_sequence_ids": sequence_ids(answer["request_id"], n)}

    def check_sample_size(self, request: dict[str, Any], n: int) -> None:
        """``num_samples`` within the server's limits (``core.check_sample_size``), refused before it is queued."""
        try:
            length = len(tinker_wire.model_input_tokens("prompt", request.get("prompt")))
        except TinkerInputError:
            return  # a malformed prompt is refused with its own reason when the request runs
        max_tokens = (request.get("sampling_params") or {}).get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            max_tokens = self.core.config.sampling.max_response_length
        check_sample_size(self.core.config.server, [length], n, max_tokens, f"num_samples={n}")

    def _enqueue(self, job: Job, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
        with self._lock:
            request_id = f"arctic-rl-{next(self._ids)}"
            self.futures[request_id] = self._queue.submit(job)
            while len(self.futures) > MAX_FUTURES and next(iter(self.futures.values())).done():
                self.futures.popitem(last=False)
        return {"request_id": request_id, "model_id": model_id, **extra}

    def future(self, request_id: str) -> Future | None:
        with self._lock:
            return self.futures.get(request_id)

    # ------------------------------------------------------------------ the model
    def create_model(self, request: dict[str, Any]) -> dict[str, Any]:
        self.check_lora(request.get("lora_config") or {})
        optimizer = (request.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise TinkerRefusal(f"optimizer {optimizer!r} is not supported; the model's optimizer is AdamW")
        self.check_base_model(request.get("base_model"))
        if self.model_id is not None:
            raise TinkerRefusal(f"this server trains one model ({self.model_id}); start another server for another")
        model_id = new_model_id(request)
        self.core.start()
        self.model_id = model_id
        return {"model_id": self.model_id, "type": "create_model"}

    def check_lora(self, lora: dict[str, Any]) -> None:
        """The client's ``LoraConfig``: its rank must be the server's ``lora.rank`` (0: all weights train). A server
        started without LoRA whose model is not built yet takes the client's rank (``core.configure_lora``).
        The adapters go on ``lora.target_modules`` (default: every linear layer of the decoder); the output head is
        never adapted, so ``train_unembed`` is not honoured; ``train_mlp``/``train_attn`` false are refused."""
        rank = lora.get("rank", 0)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise TinkerRefusal(f"lora_config.rank must be an integer >= 0, got {rank!r}")
        unsupported = [k for k in ("train_mlp", "train_attn") if lora.get(k, True) is False and rank]
        if unsupported:
            raise TinkerRefusal(f"lora_config {', '.join(f'{k}=False' for k in unsupported)} is not supported: the adapters go "
                                "on the server's lora.target_modules; set them there")
        configured = self.core.config.lora.rank
        if rank == configured:
            return
        if configured == 0 and not self.core.started:
            try:
                self.core.configure_lora(rank)
            except ConfigError as e:  # e.g. training.zero_stage 3: the config's own error, in the SDK's shape
                raise TinkerRefusal(f"LoRA rank {rank}: {e}") from None
            return
        trains = f"LoRA adapters of rank {configured}" if configured else "all weights (no LoRA)"
        raise TinkerRefusal(f"LoRA rank {rank} is not what this server trains: {trains} (its lora.rank={configured}); "
                            f"create the training client with rank={configured}, or start a server with lora.rank: {rank}")

    def check_base_model(self, base_model: str | None) -> None:
        if base_model is not None and base_model != self.model_name:
            raise TinkerRefusal(f"base_model {base_model!r}: this server trains {self.model_name!r} only")

    def check_model(self, model_id: str | None) -> str:
        if self.model_id is None or model_id != self.model_id:
            raise TinkerRefusal(f"unknown model_id {model_id!r}" + (f"; this server's model is {self.model_id!r}"
                                                                   if self.model_id else "; create a training client first"))
        return self.model_id

    def info(self, request: dict[str, Any]) -> dict[str, Any]:
        model_id = self.check_model(request.get("model_id"))
        status, rank = self.core.status(), self.core.config.lora.rank
        return {"type": "get_info", "model_id": model_id, "model_name": self.model_name, "is_lora": bool(rank), "lora_rank": rank or None,
                "model_data": {"arch": status["model_type"], "model_name": self.model_name, "tokenizer_id": self.tokenizer_id}}

    def capabilities(self) -> dict[str, Any]:
        s = self.core.config.sampling
        return {"supported_models": [{"model_name": self.model_name, "trainable": True, "sampleable": True,
                                      "max_context_length": s.max_prompt_length + s.max_response_length}]}

    # ------------------------------------------------------------------ training
    def forward_backward(self, call: tinker_wire.ForwardBackwardCall) -> bytes:
        """Per-datum target log-probs and, unless ``forward_only``, the loss's backward over ``batch.train_batch``;
        metrics ``loss:sum``, ``num_tokens:sum``, ``num_sequences:sum``. With a backward, the trained targets'
        log-probs are the loss forward's own (``target_sources``: only the prompts run again, once each)."""
        self.check_model(call.model_id)
        tinker_losses.check_config(call.loss_fn, call.loss_fn_config)
        if self.vocab_size is None:
            self.vocab_size = int(self.core.status()["vocab_size"])
        check_vocabulary(call.datums, self.vocab_size)
        if not call.forward_only:
            batch = train_batch(call.datums, call.loss_fn)  # refusals before any work
            result = self.core.forward_backward(batch, tinker_losses.PREFIX + call.loss_fn, call.loss_fn_config,
                                                processors=["logprobs"])
            rest, plan = target_sources(call.datums, batch)
            before = None if rest is None else self.core.forward(rest, ["logprobs"])["logprobs"]
            lengths = [len(d.targets) for d in call.datums]
            values = target_logprobs(result["outputs"]["logprobs"], before, plan, lengths)
            metrics = {"loss:sum": float(result["loss"]), "num_tokens:sum": float(result["num_tokens"]),
                       "num_sequences:sum": float(len(call.datums))}
            return tinker_wire.forward_backward_output(values, lengths, metrics)
        logprobs = self.core.forward(forward_batch(call.datums), ["logprobs"])["logprobs"]  # forward only: every target
        per_datum = [logprobs[i, : len(d.targets)].double().numpy() for i, d in enumerate(call.datums)]
        loss = sum(tinker_losses.datum_loss(call.loss_fn, lp, d, call.loss_fn_config) for lp, d in zip(per_datum, call.datums))
        tokens = sum(sum(1 for w in d.weights if w) for d in call.datums)
        if not math.isfinite(loss):  # as forward_backward refuses it (its loss is the same sum)
            raise TinkerInputError(f"forward: the loss is {loss} for this request; inputs this large overflow float32 "
                                   "(loss_fn_inputs.logprobs far below the model's, or advantages too large)")
        metrics = {"loss:sum": float(loss), "num_tokens:sum": float(tokens), "num_sequences:sum": float(len(call.datums))}
        return tinker_wire.forward_backward_output(np.concatenate(per_datum), [len(lp) for lp in per_datum], metrics)

    def optim_step(self, request: dict[str, Any]) -> dict[str, Any]:
        self.check_model(request.get("model_id"))
        p = tinker_wire.adam_settings(request)  # every field in range and finite, named as the SDK names it
        adam = AdamSettings(betas=(p["beta1"], p["beta2"]), eps=p["eps"], weight_decay=p["weight_decay"],
                            max_grad_norm=p["grad_clip_norm"])
        out = self.core.optim_step(lr=p["learning_rate"], adam=adam)
        return {"metrics": {"grad_norm": float(out["grad_norm"]), "lr": float(out["lr"]), "step": float(out["step"]),
                            "step_skipped": float(out["step_skipped"])}}  # 1.0: a non-finite gradient, weights kept

    # ------------------------------------------------------------------ checkpoints
    def _folder(self, kind: str, name: str, model_id: str | None = None) -> str:
        """Where a checkpoint of ``model_id`` (default: this server's model) lives under ``server.root_dir``
        (the core confines it there, and loads only folders it wrote)."""
        return f"tinker/{(model_id or self.model_id).replace(':', '_')}/{kind}/{name}"

    def save_weights_for_sampler(self, request: dict[str, Any]) -> dict[str, Any]:
        model_id = self.check_model(request.get("model_id"))
        if request.get("kind", "snapshot") != "snapshot":
            raise TinkerRefusal(f"save_weights_for_sampler kind {request['kind']!r} is not supported (snapshot is)")
        name = checkpoint_name(request, "save_weights_for_sampler")
        if name is None:  # save_weights_and_get_sampling_client: nothing written, a sampling session of it
            self.core.sync_weights()
            self.engines_hold = tinker_wire.checkpoint_path(model_id, "sampler_weights", f"ephemeral-{uuid.uuid4().hex[:12]}")
            return {"sampling_session_id": self.new_sampling_session(self.engines_hold), "type": "save_weights_for_sampler"}
        self.core.export(self._folder("sampler_weights", name))
        self.core.sync_weights()
        self.engines_hold = tinker_wire.checkpoint_path(model_id, "sampler_weights", name)
        return {"path": self.engines_hold, "type": "save_weights_for_sampler"}

    def save_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        model_id = self.check_model(request.get("model_id"))
        name = checkpoint_name(request, "save_weights") or f"step-{self.core.status()['step']}"
        self.core.save_state(self._folder("weights", name))
        return {"path": tinker_wire.checkpoint_path(model_id, "weights", name), "type": "save_weights"}

    def load_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        if not request.get("optimizer"):
            raise TinkerRefusal("load_weights without the optimizer is not supported: arctic-rl restores weights, optimizer "
                                "and schedule together (use load_state_with_optimizer)")
        if request.get("model_id") is None:  # create_training_client_from_state_with_optimizer: create, then load
            self.create_model({**request, "lora_config": {"rank": self.core.config.lora.rank}})  # the server's
        model_id = self.check_model(request.get("model_id", self.model_id))
        source, name = tinker_wire.parse_checkpoint(request.get("path"), "weights")  # may be an earlier session's
        self.core.load_state(self._folder("weights", name, source))
        self.engines_hold = None  # the engines hold the loaded weights, which no sampler path names
        return {"path": request["path"], "model_id": model_id, "type": "load_weights"}

    # ------------------------------------------------------------------ sampling
    def new_sampling_session(self, source: str) -> str:
        session = f"sampler-{uuid.uuid4().hex[:12]}"
        self.sampling_sessions[session] = source
        return session

    def create_sampling_session(self, request: dict[str, Any]) -> dict[str, Any]:
        path = request.get("model_path")
        if path is not None:
            source, _ = tinker_wire.parse_checkpoint(path, "sampler_weights")
            self.check_model(source)
        else:
            if request.get("base_model") is None:
                raise TinkerRefusal("create_sampling_session needs model_path or base_model")
            self.check_base_model(request["base_model"])
        session = self.new_sampling_session(path or BASE)
        return {"type": "create_sampling_session", "sampling_session_id": session}

    def sampler(self, session: str) -> dict[str, Any]:
        source = self.sampling_sessions.get(session)
        if source is None:
            raise TinkerRefusal(f"unknown sampling session {session!r}")
        return {"sampler_id": session, "base_model": self.model_name, "model_path": None if source == BASE else source}

    def check_source(self, request: dict[str, Any]) -> None:
        """Refuse a sample of weights the engines do not hold (they hold the newest sampler weights)."""
        session = request.get("sampling_session_id")
        if session is not None:
            source = self.sampler(session)["model_path"] or BASE
        else:
            source = request.get("model_path") or BASE
            self.check_base_model(request.get("base_model"))
        if source != self.engines_hold:
            held = "no sampler path (a loaded state)" if self.engines_hold is None else repr(self.engines_hold)
            raise TinkerRefusal(f"cannot sample {source!r}: the engines hold {held}; only the newest weights saved for the "
                                "sampler can be sampled")

    def sample_batch(self, requests: list[dict[str, Any]]) -> list[bytes | BaseException]:
        """Sample requests with the same settings (``submit_sample``'s key) as one engine call, each prompt with
        the seed a call of its own would give it (``rollout.engines.seeds``: prompt 0 of a call seeded ``s``)."""
        eos = self.core.eos_token_id()  # starts the job on a first call
        results: list[bytes | BaseException] = [b""] * len(requests)
        valid: list[tuple[int, dict[str, Any]]] = []
        for i, request in enumerate(requests):
            try:
                self.check_source(request)
                valid.append((i, tinker_wire.sample_arguments(request, eos)))
            except Exception as e:  # noqa: BLE001  (refuses this request alone)
                results[i] = e
        for part in self._within_limits(valid):
            args = {**part[0][1], "prompts": [a["prompts"][0] for _, a in part], "seed": None}
            if part[0][1]["seed"] is not None:
                args["prompt_seeds"] = [mix_seed(a["seed"], 0) for _, a in part]
            try:
                out = self.core.sample(**args)
                for (i, _), completions in zip(part, out.completions):
                    results[i] = tinker_wire.sample_response(completions)
            except Exception as e:  # noqa: BLE001
                for i, _ in part:
                    results[i] = e
        return results

    def _within_limits(self, valid: list[tuple[int, dict[str, Any]]]) -> list[list[tuple[int, dict[str, Any]]]]:
        """``valid`` (one setting of ``n`` and ``max_tokens``) in consecutive engine calls, each within the server's
        sample limits (each request alone is, ``check_sample_size``)."""
        server, parts, samples, tokens = self.core.config.server, [], 0, 0
        for item in valid:
            args = item[1]
            max_tokens = args["max_tokens"] or self.core.config.sampling.max_response_length
            more = (args["n"], args["n"] * (len(args["prompts"][0]) + max_tokens))
            if not parts or samples + more[0] > server.max_samples_per_request or tokens + more[1] > server.max_sample_tokens_per_request:
                parts.append([])
                samples, tokens = 0, 0
            parts[-1].append(item)
            samples, tokens = samples + more[0], tokens + more[1]
        return parts


def checkpoint_name(request: dict[str, Any], operation: str) -> str | None:
    """A save request's ``path``: the checkpoint's name (a string), or None when it is left out."""
    name = request.get("path")
    if name is not None and not isinstance(name, str):
        raise TinkerInputError(f"{operation}: path must be a string (the checkpoint's name), got {name!r:.80}")
    return name


def new_model_id(request: dict[str, Any]) -> str:
    """The model id of a ``create_model`` request, ``<session_id>:train:<model_seq_id>``; it names checkpoint folders
    (``tinker/<model_id>/...`` under ``server.root_dir``), so ``session_id`` must be a plain name."""
    session, seq = request.get("session_id"), request.get("model_seq_id", 0)
    if not isinstance(session, str) or not SESSION_ID.fullmatch(session):
        raise TinkerInputError(f"create_model: session_id must be a name of letters, digits and _.- (as create_session "
                               f"answers), got {session!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise TinkerInputError(f"create_model: model_seq_id must be an integer >= 0, got {seq!r}")
    return f"{session}:train:{seq}"


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids the SDK stamps on a sample's sequences, one per requested sample."""
    return [f"{request_id}:{i}" for i in range(n)]
