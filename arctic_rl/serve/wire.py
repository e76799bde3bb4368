"""The service's wire format: one op's ``Message`` as bytes (JSON header + safetensors), the same for HTTP and Ray.

Layout of a body (requests and replies alike; content type ``application/x-arctic-rl``)::

    offset  size  field
    0       4     magic, the ASCII bytes "ARLW"
    4       8     N, the header's length in bytes: unsigned 64-bit little-endian
    12      N     header: a UTF-8 JSON object (no NaN/Infinity, no duplicate keys) with exactly the keys
                    "version"    1 (the protocol version, an integer)
                    "op"         the operation's name: a letter, then up to 63 of [A-Za-z0-9_.-]
                    "meta"       a JSON object: the message's metadata (a reply's non-finite float, e.g. the
                                 grad_norm of a skipped step, is the string "NaN", "Infinity" or "-Infinity";
                                 a request's is refused)
                    "timeout_s"  (optional) null or a positive number: how long the caller waits (an op
                                 still queued after that is not started)
                    "error"      (optional) null or {"error": "<ServiceError class name>", "message": "..."}
                                 (replies only: the op failed and the message has no content)
    12+N    rest  tensors: a safetensors file (https://github.com/huggingface/safetensors), or
                  nothing when the message has no tensors. dtypes: F32 F64 BF16 F16 I64 I32 BOOL U8.

A safetensors file is itself an 8-byte little-endian length, a JSON object mapping each tensor's name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that follows, packed without
gaps), then the data, row-major and little-endian. Nothing is pickled. ``decode`` refuses anything else
with ``RequestError`` (``PayloadTooLarge`` for a body over the limit) and a reason. Limits (``WireLimits``):
the server's body size (``max_request_bytes`` in ``GET /v1/health``), 64 MiB of JSON, 64 levels of
nesting, 4096 tensors of at most 32 dimensions.

Over HTTP: ``POST /v1/ops/{op}`` with this body, ``Content-Type: application/x-arctic-rl`` and
``Authorization: Bearer <token>``; a 200 reply is a wire body for the same op, a failure is the JSON
``{"error": "<ServiceError class name>", "message": "..."}`` with that error's status. Over Ray the same
bytes travel, and a failure is a wire reply whose header carries that object as "error".
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch

from arctic_rl.serve.errors import ERRORS_BY_NAME, PayloadTooLarge, RequestError, ServiceError
from arctic_rl.serve.transport import Message

PROTOCOL_VERSION = 1
CONTENT_TYPE = "application/x-arctic-rl"
MAGIC = b"ARLW"
PREAMBLE_BYTES = len(MAGIC) + 8
OP_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
DTYPES = {  # torch dtype -> safetensors name; nothing else crosses the wire
    torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8",
}
ITEM_BYTES = {"F32": 4, "F64": 8, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "BOOL": 1, "U8": 1}
_HEADER_KEYS = {"version", "op", "meta", "timeout_s", "error"}
_MAX_NDIM = 32


@dataclass(frozen=True)
class WireLimits:
    """What ``decode`` accepts. ``max_bytes=None``: no size limit (a client reading its server's replies)."""

    max_bytes: int | None = 1 << 30
    max_tensors: int = 4096
    max_json_bytes: int = 64 << 20
    max_json_depth: int = 64


@dataclass(frozen=True)
class Frame:
    """One body: the op's name, its message, the caller's timeout (requests) or an error (failed replies)."""

    op: str
    message: Message
    timeout_s: float | None = None
    error: dict[str, str] | None = None  # {"error": class name, "message": text}


def encode(frame: Frame, limits: WireLimits = WireLimits()) -> bytes:
    """``frame`` as wire bytes; ``RequestError`` names what cannot be sent (an op name, a meta value, a dtype)."""
    _check_op(frame.op)
    _check_timeout(frame.timeout_s)
    if not isinstance(frame.message.meta, dict):
        raise RequestError(f"meta must be a dict, got {type(frame.message.meta).__name__}")
    _check_json(frame.message.meta, "meta", limits.max_json_depth)
    header = {"version": PROTOCOL_VERSION, "op": frame.op, "meta": frame.message.meta}
    if frame.timeout_s is not None:
        header["timeout_s"] = frame.timeout_s
    if frame.error is not None:
        header["error"] = _checked_error(frame.error)
    header_bytes = json.dumps(header, allow_nan=False, separators=(",", ":")).encode()
    if len(header_bytes) > limits.max_json_bytes:
        raise RequestError(f"the JSON header is {len(header_bytes)} bytes, over the limit of {limits.max_json_bytes}")
    return MAGIC + len(header_bytes).to_bytes(8, "little") + header_bytes + _tensor_bytes(frame.message.tensors, limits)


def decode(data: bytes, limits: WireLimits = WireLimits()) -> Frame:
    """Wire bytes to a ``Frame``; anything malformed raises ``RequestError`` (``PayloadTooLarge``) with a reason."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RequestError(f"a wire body is bytes, got {type(data).__name__}")
    data = bytes(data)
    if limits.max_bytes is not None and len(data) > limits.max_bytes:
        raise PayloadTooLarge(f"the body is {len(data)} bytes, over the limit of {limits.max_bytes} bytes")
    if len(data) < PREAMBLE_BYTES:
        raise RequestError(f"the body is {len(data)} bytes, shorter than the {PREAMBLE_BYTES}-byte preamble")
    if data[:4] != MAGIC:
        raise RequestError(f"the body does not start with {MAGIC!r}: not an arctic-rl wire message")
    header = _json_at(data, 4, limits, "header")
    end = PREAMBLE_BYTES + int.from_bytes(data[4:PREAMBLE_BYTES], "little")
    op, meta, timeout_s, error = _checked_header(header, limits)
    return Frame(op, Message(meta, _decode_tensors(data[end:], limits)), timeout_s, error)


def error_body(op: str, error: BaseException) -> bytes:
    """A failed op's reply: no content, ``error`` naming the exception (a Ray reply; HTTP sends JSON)."""
    return encode(Frame(op if isinstance(op, str) and OP_PATTERN.fullmatch(op) else "invalid", Message(),
                        error=error_fields(error)))


def open_reply(data: bytes, op: str) -> Message:
    """A reply's message; raises the ``ServiceError`` it carries, or ``ServiceError`` if it is malformed."""
    try:
        frame = decode(data, WireLimits(max_bytes=None))
    except RequestError as e:
        raise ServiceError(f"a malformed reply to {op!r}: {e}") from None
    if frame.error is not None:
        raise error_from_fields(frame.error)
    if frame.op != op:
        raise ServiceError(f"a reply for {frame.op!r} came back to {op!r}")
    return Message(read_nonfinite(frame.message.meta), frame.message.tensors)  # a reply's non-finite floats (readable_json)


NONFINITE_JSON = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def readable_json(value: Any) -> Any:
    """``value`` (a reply's JSON data) with every non-finite float as the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"``: JSON has no such number, and a result must always render (pydantic, and so the Tinker SDK,
    reads these strings back as floats, as ``float()`` does)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {key: readable_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [readable_json(item) for item in value]
    return value


def read_nonfinite(value: Any) -> Any:
    """The inverse of :func:`readable_json` for a reply's meta: the strings ``"NaN"``, ``"Infinity"`` and
    ``"-Infinity"`` back to floats."""
    if isinstance(value, str):
        return NONFINITE_JSON.get(value, value)
    if isinstance(value, dict):
        return {key: read_nonfinite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [read_nonfinite(item) for item in value]
    return value


def error_fields(error: BaseException) -> dict[str, str]:
    """The ``{"error": class name, "message": text}`` object both transports send for a failed op."""
    return {"error": type(error).__name__, "message": str(error)}


def error_from_fields(fields: dict[str, str]) -> ServiceError:
    """The ``ServiceError`` subclass named in ``fields`` with the server's message (``ServiceError`` with
    the name prefixed for any other exception, e.g. a ``RuntimeError`` inside the server)."""
    fields = _checked_error(fields)
    name, message = fields["error"], fields["message"]
    if name in ERRORS_BY_NAME:
        return ERRORS_BY_NAME[name](message)
    return ServiceError(f"{name}: {message}")


def _check_op(op: Any) -> None:
    if not isinstance(op, str) or not OP_PATTERN.fullmatch(op):
        raise RequestError(f"op must be a letter then up to 63 of [A-Za-z0-9_.-], got {op!r}")


def _check_timeout(timeout_s: Any) -> None:
    if timeout_s is None:
        return
    if type(timeout_s) not in (int, float) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise RequestError(f"timeout_s must be null or a positive number, got {timeout_s!r}")


def _checked_error(error: Any) -> dict[str, str]:
    if not (isinstance(error, dict) and set(error) == {"error", "message"}
            and all(isinstance(v, str) for v in error.values())):
        raise RequestError(f'error must be {{"error": str, "message": str}}, got {error!r:.200}')
    return error


def _check_json(value: Any, where: str, max_depth: int, depth: int = 0) -> None:
    """Refuse what JSON cannot carry faithfully: non-str keys, NaN/inf, other types, deep nesting."""
    if depth > max_depth:
        raise RequestError(f"{where} is nested deeper than {max_depth} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise RequestError(f"{where} has a non-string key {key!r}")
            _check_json(item, f"{where}.{key}", max_depth, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]", max_depth, depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"{where} is {value}: JSON has no NaN or infinity")
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise RequestError(f"{where} is a {type(value).__name__}; meta holds only JSON values (tensors go in tensors)")


def _tensor_bytes(tensors: dict[str, torch.Tensor], limits: WireLimits) -> bytes:
    if not isinstance(tensors, dict):
        raise RequestError(f"tensors must be a dict, got {type(tensors).__name__}")
    if len(tensors) > limits.max_tensors:
        raise RequestError(f"{len(tensors)} tensors, over the limit of {limits.max_tensors}")
    if not tensors:
        return b""
    ready, storages = {}, set()
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise RequestError(f"tensors maps names (str) to torch.Tensor, got {name!r}: {type(tensor).__name__}")
        if tensor.dtype not in DTYPES:
            raise RequestError(f"tensor {name!r} has dtype {tensor.dtype}; the wire carries only "
                               f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES)}")
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if tensor.numel() and storage in storages:  # safetensors refuses tensors sharing memory
            tensor = tensor.clone()
        storages.add(storage)
        ready[name] = tensor
    return safetensors.torch.save(ready)


def _json_at(data: bytes, offset: int, limits: WireLimits, what: str) -> Any:
    """The JSON object whose 8-byte little-endian length is at ``offset``."""
    if len(data) < offset + 8:
        raise RequestError(f"the {what} is truncated: {len(data) - offset} bytes where an 8-byte length is due")
    size = int.from_bytes(data[offset:offset + 8], "little")
    if size > limits.max_json_bytes:
        raise RequestError(f"the {what} declares {size} bytes of JSON, over the limit of {limits.max_json_bytes}")
    if len(data) < offset + 8 + size:
        raise RequestError(f"the {what} declares {size} bytes of JSON but only {len(data) - offset - 8} follow")
    try:
        return json.loads(data[offset + 8:offset + 8 + size].decode("utf-8"),
                          parse_constant=_refuse_constant, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise RequestError(f"the {what}'s JSON is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(f"the {what} is not valid JSON: {e}") from None


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate keys in an object")
    return result


def _checked_header(header: Any, limits: WireLimits) -> tuple[str, dict, float | None, dict | None]:
    if not isinstance(header, dict):
        raise RequestError(f"the header must be a JSON object, got {type(header).__name__}")
    if set(header) - _HEADER_KEYS or not {"version", "op", "meta"} <= set(header):
        raise RequestError(f"the header has keys {sorted(header)}; expected version, op, meta "
                           f"and optionally timeout_s, error")
    if type(header["version"]) is not int or header["version"] != PROTOCOL_VERSION:
        raise RequestError(f"protocol version {header['version']!r} is not supported (this side speaks "
                           f"{PROTOCOL_VERSION})")
    _check_op(header["op"])
    if not isinstance(header["meta"], dict):
        raise RequestError(f"meta must be a JSON object, got {type(header['meta']).__name__}")
    _check_json(header["meta"], "meta", limits.max_json_depth)
    timeout_s = header.get("timeout_s")
    _check_timeout(timeout_s)
    error = header.get("error")
    return header["op"], header["meta"], timeout_s, None if error is None else _checked_error(error)


def _decode_tensors(data: bytes, limits: WireLimits) -> dict[str, torch.Tensor]:
    """Check the safetensors header ourselves (clear reasons, our dtypes and limits), then load it."""
    if not data:
        return {}
    header = _json_at(data, 0, limits, "safetensors header")
    if not isinstance(header, dict):
        raise RequestError(f"the safetensors header must be a JSON object, got {type(header).__name__}")
    header.pop("__metadata__", None)
    if len(header) > limits.max_tensors:
        raise RequestError(f"{len(header)} tensors, over the limit of {limits.max_tensors}")
    spans = sorted(_tensor_span(name, entry) for name, entry in header.items())
    position, data_bytes = 0, len(data) - 8 - int.from_bytes(data[:8], "little")
    for begin, end, name in spans:
        if begin != position:
            raise RequestError(f"tensor {name!r} starts at byte {begin}, expected {position} (data must be packed)")
        position = end
    if position != data_bytes:
        raise RequestError(f"the tensors' data is {data_bytes} bytes but the header describes {position}")
    try:
        return safetensors.torch.load(data)
    except Exception as e:  # the checks above should leave nothing for safetensors to refuse
        raise RequestError(f"the tensors are not a valid safetensors file: {e}") from None


def _tensor_span(name: str, entry: Any) -> tuple[int, int, str]:
    if not (isinstance(entry, dict) and set(entry) == {"dtype", "shape", "data_offsets"}):
        raise RequestError(f"tensor {name!r}: expected {{dtype, shape, data_offsets}}, got {entry!r:.200}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in ITEM_BYTES:
        raise RequestError(f"tensor {name!r} has dtype {dtype!r}; the wire carries only {', '.join(ITEM_BYTES)}")
    if not (isinstance(shape, list) and len(shape) <= _MAX_NDIM
            and all(type(n) is int and n >= 0 for n in shape)):
        raise RequestError(f"tensor {name!r} has shape {shape!r:.200}; expected at most {_MAX_NDIM} "
                           f"non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise RequestError(f"tensor {name!r} has data_offsets {offsets!r:.200}; expected [begin, end]")
    if offsets[1] - offsets[0] != math.prod(shape) * ITEM_BYTES[dtype]:
        raise RequestError(f"tensor {name!r}: shape {shape} of {dtype} needs "
                           f"{math.prod(shape) * ITEM_BYTES[dtype]} bytes, data_offsets span {offsets[1] - offsets[0]}")
    return offsets[0], offsets[1], name
