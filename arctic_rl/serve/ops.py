"""The operations as messages: ``CoreHandler.call(op, Message)`` decodes a request into a call of one of the
core's operations (``operations.Operations``, whose method names are the table of ``op``s) and encodes its
answer. Every transport (in-process, HTTP, Ray) goes through here, so a request means the same thing whichever
way it came.

Requests and replies (``meta`` is JSON, tensors are named):
    sample            meta: prompts ([[int]] or [str]), n, max_tokens, temperature, top_p, seed, prompt_seeds, max_staleness,
                      stop_token_ids ([int], optional: a completion also ends at one of them, kept)
                      -> tensors token_ids [T] int64, logprobs [T] float32, lengths [P*n] int64 (flat, prompt-major),
                         prompt_ids, prompt_lengths [P] (the prompts as token ids), weight_versions [P*n] int64 (the
                         weights each completion was sampled with: 0 at start, n after the n-th sync_weights);
                         meta: text [[str]], finish_reason [[str]]
    forward           a TrainBatch; meta: processors [str] -> one tensor per processor output
    forward_backward  a TrainBatch (with advantages); meta: loss, loss_config {}, request_id, processors [] -> meta: loss and
                      metrics; tensors: the processors' outputs (from the loss's own forward)
    optim_step        meta: lr, advance_schedule, request_id, adam {beta1, beta2, eps, weight_decay, max_grad_norm}
                      (all optional) -> meta: grad_norm, lr, step, step_skipped (a non-finite gradient's step)
                      request_id (optional, <= 128 chars): a retry with the same id gets the first call's answer
                      with replayed: true, instead of running again (idempotency.py)
    zero_grad, sleep, wake                            -> meta
    sync_weights      -> meta: seconds, bytes, num_tensors, weight_version (the engines' version after it)
    status            -> meta: step, lr, model (the server's config's), model_type, vocab_size, world_size,
                         engine_replicas [{replica, pid, ip, node_id, weight_version}], ...
    save_state, load_state, export                    meta: path (relative to server.root_dir) -> meta
"""

from __future__ import annotations

from typing import Any

from arctic_rl.serve.batch import AdamSettings, TrainBatch, finite_float, learning_rate
from arctic_rl.serve.errors import RequestError, UnknownOperation
from arctic_rl.serve.idempotency import check_request_id
from arctic_rl.serve.operations import OPERATIONS, Operations
from arctic_rl.serve.transport import Message


def _processors(meta: dict[str, Any], default: list[str]) -> list[str]:
    """A request's ``processors``: a list of names (``default`` when absent)."""
    processors = _field(meta, "processors", list, default)
    if not all(isinstance(p, str) for p in processors):
        raise RequestError("processors must be a list of names")
    return processors


def _field(meta: dict, name: str, kind: type | tuple, default: Any = ..., optional: bool = False) -> Any:
    if name not in meta or (optional and meta[name] is None):
        if default is ...:
            raise RequestError(f"{name} is required")
        return default
    value = meta[name]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise RequestError(f"{name} must be {kind}, got a bool")
    if not isinstance(value, kind):
        raise RequestError(f"{name} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _prompts(meta: dict) -> list:
    prompts = _field(meta, "prompts", list)
    for i, p in enumerate(prompts):
        ok = isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p))
        if not ok:
            raise RequestError(f"prompts[{i}] must be a string or a list of token ids")
    return prompts


def _known(meta: dict, allowed: set[str], op: str) -> None:
    extra = set(meta) - allowed
    if extra:
        raise RequestError(f"{op}: unknown fields {sorted(extra)}; known: {sorted(allowed)}")


class CoreHandler:
    """The ``Handler`` over a core (``ServiceCore``, or ``RankedCore``, its several-rank twin): what every transport
    serves. Its table has one entry per operation of ``Operations``: the operations whose request has fields or
    tensors have a decoder here (``_sample`` ...); the others take none."""

    def __init__(self, core: Operations) -> None:
        if not isinstance(core, Operations):
            raise TypeError(f"CoreHandler serves an Operations (a core), not a {type(core).__name__}")
        self.core = core
        decoders = {"sample": self._sample, "forward": self._forward, "forward_backward": self._forward_backward,
                    "optim_step": self._optim_step, "save_state": self._path_op, "load_state": self._path_op,
                    "export": self._path_op}
        # every name is an abstract method of Operations, which core's class defines (checked when it was defined)
        self._operations = {op: getattr(core, op) for op in OPERATIONS}
        self._decoders = {op: decoders.get(op, self._no_arguments) for op in OPERATIONS}

    def call(self, op: str, request: Message, timeout_s: float | None = None) -> Message:
        if op not in self._decoders:
            raise UnknownOperation(f"unknown operation {op!r}; known: {list(OPERATIONS)}")
        return self._decoders[op](op, request, timeout_s)

    def close(self) -> None:
        self.core.close()

    def _no_arguments(self, op: str, request: Message, timeout_s: float | None) -> Message:
        _known(request.meta, set(), op)
        if request.tensors:
            raise RequestError(f"{op} takes no tensors")
        return Message(self._operations[op](timeout_s=timeout_s))

    def _sample(self, op: str, request: Message, timeout_s: float | None) -> Message:
        m = request.meta
        _known(m, {"prompts", "n", "max_tokens", "temperature", "top_p", "seed", "prompt_seeds", "stop_token_ids", "max_staleness"}, op)
        seeds = _field(m, "prompt_seeds", list, None, optional=True)
        stops = _field(m, "stop_token_ids", list, [], optional=True)
        for name, values in (("prompt_seeds", seeds or []), ("stop_token_ids", stops)):
            if not all(isinstance(s, int) and not isinstance(s, bool) for s in values):
                raise RequestError(f"{name} must be a list of integers")
        out = self._operations[op](
            _prompts(m), n=_field(m, "n", int, 1), max_tokens=_field(m, "max_tokens", int, None, optional=True),
            temperature=finite_float("temperature", m.get("temperature", 1.0)), top_p=finite_float("top_p", m.get("top_p", 1.0)),
            seed=_field(m, "seed", int, None, optional=True), prompt_seeds=seeds, timeout_s=timeout_s, stop_token_ids=stops,
            max_staleness=_field(m, "max_staleness", int, None, optional=True),
        )
        return out.to_message()

    def _forward(self, op: str, request: Message, timeout_s: float | None) -> Message:
        _known(request.meta, {"processors"}, op)
        processors = _processors(request.meta, ["logprobs"])
        if not processors:
            raise RequestError("processors must be a non-empty list of names")
        return Message({}, self._operations[op](TrainBatch.from_message(request), processors, timeout_s=timeout_s))

    def _forward_backward(self, op: str, request: Message, timeout_s: float | None) -> Message:
        _known(request.meta, {"loss", "loss_config", "request_id", "processors"}, op)
        loss, config = _field(request.meta, "loss", str), _field(request.meta, "loss_config", dict, {})
        request_id = check_request_id(request.meta.get("request_id"))
        out = dict(self._operations[op](TrainBatch.from_message(request), loss, config, timeout_s=timeout_s,
                                        request_id=request_id, processors=_processors(request.meta, [])))
        return Message(out, out.pop("outputs", {}))

    def _optim_step(self, op: str, request: Message, timeout_s: float | None) -> Message:
        _known(request.meta, {"lr", "request_id", "advance_schedule", "adam"}, op)
        lr = learning_rate("lr", request.meta.get("lr"))
        advance = _field(request.meta, "advance_schedule", bool, True)
        request_id = check_request_id(request.meta.get("request_id"))
        adam = _adam(_field(request.meta, "adam", dict, None, optional=True))
        return Message(self._operations[op](lr=lr, timeout_s=timeout_s, request_id=request_id, advance_schedule=advance,
                                            adam=adam))

    def _path_op(self, op: str, request: Message, timeout_s: float | None) -> Message:
        _known(request.meta, {"path"}, op)
        path = _field(request.meta, "path", str)
        reply = self._operations[op](path, timeout_s=timeout_s)
        return Message({**reply, "path": path})  # the client's own (relative) path, not the server's layout


ADAM_FIELDS = ("beta1", "beta2", "eps", "weight_decay", "max_grad_norm")


def _adam(fields: dict | None) -> AdamSettings | None:
    """``optim_step``'s ``adam`` meta (all of ``ADAM_FIELDS``, finite numbers) as ``AdamSettings``."""
    if fields is None:
        return None
    if set(fields) != set(ADAM_FIELDS):
        raise RequestError(f"adam must have exactly the fields {list(ADAM_FIELDS)}, got {sorted(fields)}")
    v = {name: finite_float(f"adam.{name}", fields[name]) for name in ADAM_FIELDS}
    return AdamSettings(betas=(v["beta1"], v["beta2"]), eps=v["eps"], weight_decay=v["weight_decay"],
                        max_grad_norm=v["max_grad_norm"])

