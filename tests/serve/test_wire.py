"""The wire format in-process: round trips, refusals with reasons, and fuzzed bodies raising only RequestError."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from arctic_rl.serve import wire
from arctic_rl.serve.errors import ERRORS_BY_NAME, PayloadTooLarge, RequestError, ServiceError
from arctic_rl.serve.transport import Message
from tests.serve.wire_samples import VALID_BODY, assert_same_tensors, every_dtype, mutated_bodies

FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def test_round_trip_keeps_op_meta_timeout_and_every_tensor():
    meta = {"prompts": ["a", "b"], "n": 2, "nested": {"x": [1.5, None, True]}, "empty": {}}
    frame = wire.decode(wire.encode(wire.Frame("forward_backward", Message(meta, every_dtype()), timeout_s=2.5)))
    assert (frame.op, frame.timeout_s, frame.error) == ("forward_backward", 2.5, None)
    assert frame.message.meta == meta
    assert_same_tensors(frame.message.tensors, every_dtype())


def test_layout_is_magic_length_json_then_safetensors():
    body = wire.encode(wire.Frame("echo", Message({"k": 1}, {"x": torch.ones(2)})))
    size = int.from_bytes(body[4:12], "little")
    assert body[:4] == b"ARLW"
    assert json.loads(body[12:12 + size]) == {"version": 1, "op": "echo", "meta": {"k": 1}}
    tensor_header_size = int.from_bytes(body[12 + size:20 + size], "little")
    assert json.loads(body[20 + size:20 + size + tensor_header_size])["x"]["dtype"] == "F32"


def test_no_tensors_means_no_safetensors_part():
    body = wire.encode(wire.Frame("status", Message()))
    assert len(body) == 12 + int.from_bytes(body[4:12], "little")
    assert wire.decode(body).message == Message()


def test_tensors_sharing_memory_are_sent_apart():
    base = torch.arange(10.0)
    frame = wire.decode(wire.encode(wire.Frame("echo", Message({}, {"a": base[:4], "b": base[4:], "all": base}))))
    assert_same_tensors(frame.message.tensors, {"a": base[:4], "b": base[4:], "all": base})


@pytest.mark.parametrize(("op", "message", "reason"), [
    ("echo", Message({}, {"x": torch.zeros(2, dtype=torch.complex64)}), "dtype torch.complex64"),
    ("echo", Message({}, {"x": torch.zeros(2, dtype=torch.int16)}), "dtype torch.int16"),
    ("echo", Message({}, {"x": [1, 2]}), "torch.Tensor"),
    ("echo", Message({"loss": float("nan")}, {}), "meta.loss is nan"),
    ("echo", Message({"a": {1: "x"}}, {}), "non-string key 1"),
    ("echo", Message({"t": torch.ones(1)}, {}), "meta.t is a Tensor"),
    ("echo/../x", Message(), "op must be"),
    ("", Message(), "op must be"),
    ("..", Message(), "op must be"),
])
def test_encode_refuses_what_the_wire_cannot_carry(op, message, reason):
    with pytest.raises(RequestError, match=reason.replace(".", r"\.").replace("(", r"\(")):
        wire.encode(wire.Frame(op, message))


def _body(header: dict | str, tensors: bytes = b"") -> bytes:
    text = header if isinstance(header, str) else json.dumps(header)
    return b"ARLW" + len(text.encode()).to_bytes(8, "little") + text.encode() + tensors


def _safetensors(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


OK_HEADER = {"version": 1, "op": "echo", "meta": {}}


@pytest.mark.parametrize(("body", "reason"), [
    (b"", "shorter than the 12-byte preamble"),
    (b"GET / HTTP/1.1\r\n\r\n", "does not start with b'ARLW'"),
    (b"ARLW" + (2**64 - 1).to_bytes(8, "little"), "declares 18446744073709551615 bytes of JSON"),
    (b"ARLW" + (50).to_bytes(8, "little") + b"{}", "declares 50 bytes of JSON but only 2 follow"),
    (_body("not json"), "not valid JSON"),
    (_body("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    (_body('{"version": 1, "op": "echo", "meta": {"x": NaN}}'), "NaN is not JSON"),
    (_body('{"version": 1, "version": 1, "op": "echo", "meta": {}}'), "duplicate keys"),
    (_body([1, 2]), "must be a JSON object"),
    (_body({**OK_HEADER, "version": 2}), "protocol version 2 is not supported"),
    (_body({**OK_HEADER, "pickle": True}), "expected version, op, meta"),
    (_body({**OK_HEADER, "op": "a b"}), "op must be"),
    (_body({**OK_HEADER, "meta": []}), "meta must be a JSON object"),
    (_body({**OK_HEADER, "timeout_s": -1}), "timeout_s must be"),
    (_body({**OK_HEADER, "error": "boom"}), "error must be"),
    (_body(OK_HEADER, b"\x01"), "8-byte length is due"),
    (_body(OK_HEADER, _safetensors({"x": {"dtype": "I16", "shape": [1], "data_offsets": [0, 2]}}, b"..")),
     "dtype 'I16'"),
    (_body(OK_HEADER, _safetensors({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"....")),
     "shape [-1]"),
    (_body(OK_HEADER, _safetensors({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"....")),
     "needs 8 bytes"),
    (_body(OK_HEADER, _safetensors({"x": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}, b"....")),
     "starts at byte 2, expected 0"),
    (_body(OK_HEADER, _safetensors({"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"....")),
     "data is 4 bytes but the header describes 2"),
    (_body(OK_HEADER, _safetensors({"x": {"dtype": "U8", "shape": [1]}}, b".")), "expected {dtype, shape"),
])
def test_decode_refuses_malformed_bodies_with_a_reason(body, reason):
    with pytest.raises(RequestError, match=reason.replace("[", r"\[").replace("{", r"\{")):
        wire.decode(body)


def test_decode_refuses_bodies_over_the_limit_naming_size_and_limit():
    with pytest.raises(PayloadTooLarge, match="the body is 100 bytes, over the limit of 99 bytes"):
        wire.decode(b"x" * 100, wire.WireLimits(max_bytes=99))


def test_decode_refuses_too_many_tensors():
    body = wire.encode(wire.Frame("echo", Message({}, {str(i): torch.ones(1) for i in range(5)})))
    with pytest.raises(RequestError, match="5 tensors, over the limit of 4"):
        wire.decode(body, wire.WireLimits(max_tensors=4))


@pytest.mark.parametrize("name", sorted(ERRORS_BY_NAME))
def test_errors_travel_as_their_own_class_with_the_message(name):
    body = wire.error_body("optim_step", ERRORS_BY_NAME[name]("the reason"))
    with pytest.raises(ERRORS_BY_NAME[name]) as caught:
        wire.open_reply(body, "optim_step")
    assert type(caught.value) is ERRORS_BY_NAME[name] and str(caught.value) == "the reason"


def test_other_exceptions_travel_as_service_error_naming_their_type():
    with pytest.raises(ServiceError, match="^KeyError: 'x'$"):
        wire.open_reply(wire.error_body("echo", KeyError("x")), "echo")


def test_reply_for_another_op_is_refused():
    with pytest.raises(ServiceError, match="a reply for 'echo' came back to 'sample'"):
        wire.open_reply(wire.encode(wire.Frame("echo", Message())), "sample")


@FUZZ
@given(mutated_bodies())
def test_fuzzed_bodies_raise_only_request_errors(body):
    try:
        frame = wire.decode(body, wire.WireLimits(max_bytes=len(VALID_BODY) + 64))
    except RequestError:  # PayloadTooLarge is one too
        return
    assert isinstance(frame, wire.Frame)  # a flip in the data can leave a valid message
