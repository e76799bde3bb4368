"""The Tinker SDK's wire formats, read and written for ``arctic-rl serve --api tinker``: its protobuf
``ForwardBackwardRequest`` in, protobuf ``ForwardBackwardOutput`` / ``SampleResponse`` out (the message
classes are the SDK's own, ``tinker.proto.tinker_public_pb2``: the server needs the ``tinker`` package), its
JSON ``ModelInput`` and ``SamplingParams``, and its ``tinker://`` paths. Pure conversions: every refusal is a
``TinkerInputError`` naming the field."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from arctic_rl.serve.tinker.batch import Datum, TinkerInputError

SCHEME = "tinker://"
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")  # losses.py; the SDK's others are refused
KNOWN_INPUTS = {"cross_entropy": {"target_tokens", "weights"},
                "importance_sampling": {"target_tokens", "logprobs", "advantages", "weights"}}
KNOWN_INPUTS["ppo"] = KNOWN_INPUTS["cispo"] = KNOWN_INPUTS["dro"] = KNOWN_INPUTS["importance_sampling"]


def _pb():
    from tinker.proto import tinker_public_pb2  # the SDK's generated messages (imported only by this server)

    return tinker_public_pb2


@dataclass
class ForwardBackwardCall:
    """One decoded ``/api/v1/forward_backward`` body."""

    model_id: str
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    datums: list[Datum]


def _dtypes() -> dict[int, type]:
    pb = _pb()
    return {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def _tensor(name: Callable[[], str], msg, dtypes: dict[int, type]) -> np.ndarray:
    """A dense 1-D Tinker tensor as numpy (float32 or int64); ``name()`` names it in a refusal."""
    if msg.dtype not in dtypes:
        raise TinkerInputError(f"{name()}: dtype {msg.dtype} is not supported (float32, int64, int32)")
    if msg.HasField("sparse_csr"):
        raise TinkerInputError(f"{name()}: sparse tensors are not supported; send it dense")
    values = np.frombuffer(msg.dense, dtype=dtypes[msg.dtype])
    if len(msg.shape) > 1:
        raise TinkerInputError(f"{name()}: shape {list(msg.shape)}; only 1-d loss inputs are supported")
    return values


def _tokens(name: str, chunks) -> tuple[list[int], list[int]]:
    """The tokens of a protobuf ``ModelInput``'s chunks, and each chunk's length."""
    tokens: list[int] = []
    lengths: list[int] = []
    for j, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise TinkerInputError(f"{name}.chunks[{j}]: {kind} chunks are not supported (text tokens only)")
        values = np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        tokens += values
        lengths.append(len(values))
    return tokens, lengths


def read_forward_backward(body: bytes) -> ForwardBackwardCall:
    """Decode the SDK's protobuf ``ForwardBackwardRequest`` into datums (loss inputs as plain lists)."""
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001  (protobuf's DecodeError and friends)
        raise TinkerInputError(f"forward_backward: the body is not a ForwardBackwardRequest: {e}") from None
    loss = msg.loss_fn
    if loss not in LOSSES:
        raise TinkerInputError(f"loss_fn {loss!r} is not supported by arctic-rl; supported: {list(LOSSES)}")
    config: dict[str, float] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise TinkerInputError(f"loss_fn_config.{key}: text values are not supported")
        config[key] = value.number
    datums, known, dtypes = [], KNOWN_INPUTS[loss], _dtypes()
    for i, d in enumerate(msg.data):
        # provenance spans (which sampled sequence each token came from) only attribute tokens; the losses served
        # here do not read them (stable_reinforce, which does, is refused above)
        unknown = set(d.loss_fn_inputs) - known
        if unknown:
            raise TinkerInputError(f"datum {i}: loss_fn_inputs {sorted(unknown)} are not inputs of {loss!r}; "
                                   f"known: {sorted(known)}")
        inputs = {name: _tensor(lambda: f"datum {i}: loss_fn_inputs.{name}", t, dtypes) for name, t in d.loss_fn_inputs.items()}
        if "target_tokens" not in inputs:
            raise TinkerInputError(f"datum {i}: loss_fn_inputs.target_tokens is required")
        tokens, chunk_lengths = _tokens(f"datum {i}: model_input", d.model_input)
        weights = inputs["weights"].tolist() if "weights" in inputs else [1.0] * len(tokens)  # absent: every target
        datums.append(Datum(tokens=tokens, targets=inputs["target_tokens"].astype(np.int64).tolist(), weights=weights,
                            advantages=inputs.get("advantages", np.zeros(0)).tolist(),
                            logprobs=inputs.get("logprobs", np.zeros(0)).tolist(), chunk_lengths=chunk_lengths))
    if not datums:
        raise TinkerInputError("forward_backward: data is empty")
    return ForwardBackwardCall(msg.model_id, loss, config, msg.forward_only, datums)


def forward_backward_output(values: np.ndarray, lengths: list[int], metrics: dict[str, float]) -> bytes:
    """The protobuf ``ForwardBackwardOutput``: per datum its targets' ``logprobs`` (float32; ``values`` holds them
    datum after datum, ``lengths[i]`` for datum ``i``), and ``metrics``."""
    pb = _pb()
    data = np.ascontiguousarray(values, dtype=np.float32)
    offsets = 4 * np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)  # each datum's bytes
    field = pb.BatchedTensor(data=data.tobytes(), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32)
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(lengths))
    record.fields["logprobs"].CopyFrom(field)
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    out.loss_fn_outputs.append(record)
    return out.SerializeToString()


def sample_response(completions) -> bytes:
    """The protobuf ``SampleResponse`` of one prompt's completions (``rollout.engines.base.Completion``)."""
    pb = _pb()
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    out = pb.SampleResponse()
    for c in completions:
        out.sequences.add(stop_reason=reasons[c.finish_reason], tokens=np.asarray(c.token_ids, np.int32).tobytes(),
                          logprobs=np.asarray(c.logprobs, np.float32).tobytes())
    return out.SerializeToString()


def model_input_tokens(name: str, model_input: Any) -> list[int]:
    """The token ids of a JSON ``ModelInput`` (``{"chunks": [{"type": "encoded_text", "tokens": [...]}]}``)."""
    chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
    if not isinstance(chunks, list):
        raise TinkerInputError(f"{name}: expected a ModelInput with chunks")
    tokens: list[int] = []
    for j, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise TinkerInputError(f"{name}.chunks[{j}]: {chunk.get('type') if isinstance(chunk, dict) else chunk!r} "
                                   "chunks are not supported (text tokens only)")
        values = chunk.get("tokens")
        if not isinstance(values, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
            raise TinkerInputError(f"{name}.chunks[{j}].tokens must be a list of token ids")
        tokens += values
    return tokens


SAMPLE_FIELDS = {"num_samples", "prompt", "sampling_params", "base_model", "model_path", "sampling_session_id", "seq_id",
                 "prompt_logprobs", "topk_prompt_logprobs", "topk_sample_logprobs", "target_prompt_logprobs",
                 "prompt_alt_tokens_k", "prompt_logprobs_last_n", "record_stability_info", "type"}
_OFF = {"prompt_logprobs": (None, False), "topk_prompt_logprobs": (0,), "topk_sample_logprobs": (0,),
        "target_prompt_logprobs": (None,), "prompt_alt_tokens_k": (0,), "prompt_logprobs_last_n": (None,),
        "record_stability_info": (None, False)}


def sample_arguments(request: dict[str, Any], eos_token_id: int | None) -> dict[str, Any]:
    """``ServiceCore.sample``'s arguments for a JSON ``SampleRequest``; what the engine cannot do is refused.
    The engine always stops at end-of-sequence, so ``stop`` token ids (which replace the default stop set in
    the SDK) are served when they include ``eos_token_id``; stop strings and ``[]`` (no stop at all) are not."""
    unknown = set(request) - SAMPLE_FIELDS
    if unknown:
        raise TinkerInputError(f"sample: unknown fields {sorted(unknown)}")
    for key, off in _OFF.items():
        if request.get(key, off[0]) not in off:
            raise TinkerInputError(f"sample: {key}={request[key]!r} is not supported by arctic-rl")
    params = request.get("sampling_params") or {}
    if params.get("top_k", -1) not in (-1, 0):
        raise TinkerInputError(f"sampling_params.top_k={params['top_k']!r} is not supported (top_p is)")
    stop = params.get("stop")
    if stop is not None and not (isinstance(stop, list) and stop and all(isinstance(t, int) and not isinstance(t, bool)
                                                                         for t in stop) and eos_token_id in stop):
        raise TinkerInputError(f"sampling_params.stop={stop!r} is not supported: the engine always stops at end-of-sequence "
                               f"(token {eos_token_id}); stop token ids that include it are served, stop strings are not")
    return {"prompts": [model_input_tokens("prompt", request.get("prompt"))], "n": int(request.get("num_samples", 1)),
            "stop_token_ids": sorted(set(stop or []) - {eos_token_id}),
            "max_tokens": params.get("max_tokens"), "temperature": float(params.get("temperature", 1.0)),
            "top_p": float(params.get("top_p", 1.0)), "seed": params.get("seed")}


ADAM_RANGES = {  # (low, low included, high excluded, the range in words): every value also finite
    "learning_rate": (0.0, False, math.inf, "a finite number > 0"), "beta1": (0.0, True, 1.0, "in [0, 1)"),
    "beta2": (0.0, True, 1.0, "in [0, 1)"), "eps": (0.0, False, math.inf, "a finite number > 0"),
    "weight_decay": (0.0, True, math.inf, "a finite number >= 0"),
    "grad_clip_norm": (0.0, True, math.inf, "a finite number >= 0 (0: no clipping)"),
}


def adam_settings(request: dict[str, Any]) -> dict[str, float]:
    """The fields of an ``OptimStepRequest``'s ``adam_params`` (the SDK's defaults for the ones left out)."""
    if "optimizer_params" in request:
        raise TinkerInputError("optim_step: only AdamParams are supported (the model's optimizer is AdamW)")
    params = request.get("adam_params") or {}
    defaults = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
    unknown = set(params) - set(defaults)
    if unknown:
        raise TinkerInputError(f"adam_params: unknown fields {sorted(unknown)}")
    out = {key: params.get(key, default) for key, default in defaults.items()}
    bad = [key for key, value in out.items() if isinstance(value, bool) or not isinstance(value, (int, float))]
    if bad:
        raise TinkerInputError(f"adam_params.{bad[0]} must be a number, got {out[bad[0]]!r}")
    for key, value in out.items():
        low, low_closed, high, what = ADAM_RANGES[key]
        if not (math.isfinite(value) and (value >= low if low_closed else value > low) and value < high):
            raise TinkerInputError(f"adam_params.{key} must be {what}, got {value!r}")
    return {key: float(value) for key, value in out.items()}


def checkpoint_path(model_id: str, kind: str, name: str) -> str:
    """``tinker://<model_id>/<kind>/<name>`` (kind: ``weights`` or ``sampler_weights``)."""
    return f"{SCHEME}{model_id}/{kind}/{name}"


def parse_checkpoint(path: str, kind: str) -> tuple[str, str]:
    """``(model_id, name)`` of a ``tinker://<model_id>/<kind>/<name>`` path of this server."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise TinkerInputError(f"path {path!r}: expected {SCHEME}<model_id>/{kind}/<name>")
    model_id, _, rest = path.removeprefix(SCHEME).partition("/")
    found, _, name = rest.partition("/")
    if found != kind or not model_id or not name:
        raise TinkerInputError(f"path {path!r}: expected {SCHEME}<model_id>/{kind}/<name>")
    return model_id, name
