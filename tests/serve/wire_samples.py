"""What the transport tests send: a tensor of every wire dtype, a valid body, and hypothesis mutations of it."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from arctic_rl.serve import wire
from arctic_rl.serve.transport import Message


def every_dtype() -> dict[str, torch.Tensor]:
    """One tensor per wire dtype, empty ones, a scalar and a non-contiguous view."""
    g = torch.Generator().manual_seed(0)
    tensors = {str(d).removeprefix("torch."): (torch.randn(2, 3, generator=g) * 100).to(d) for d in wire.DTYPES}
    tensors["bool"] = torch.tensor([[True, False, True]])
    tensors["empty_f32"] = torch.zeros(0, 4)
    tensors["empty_i64"] = torch.zeros(0, dtype=torch.int64)
    tensors["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    tensors["transposed"] = torch.arange(6, dtype=torch.int32).reshape(2, 3).t()
    return tensors


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and values (exactly)."""
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert (got[name].dtype, got[name].shape) == (tensor.dtype, tensor.shape), name
        assert torch.equal(got[name], tensor), name


VALID_BODY = wire.encode(wire.Frame("echo", Message({"prompts": ["a", "b"], "nested": {"x": [1.5, None, True]}},
                                                    every_dtype()), timeout_s=5.0))


@st.composite
def mutated_bodies(draw) -> bytes:
    """Random bytes, or ``VALID_BODY`` truncated, bit-flipped, or with a huge or wrong declared length."""
    body = VALID_BODY
    kind = draw(st.sampled_from(["random", "truncated", "flipped", "length"]))
    if kind == "random":
        return draw(st.binary(max_size=2048)) if draw(st.booleans()) else b"ARLW" + draw(st.binary(max_size=2048))
    if kind == "truncated":
        return body[:draw(st.integers(0, len(body) - 1))]
    if kind == "flipped":
        flipped = bytearray(body)
        for position in draw(st.lists(st.integers(0, len(body) * 8 - 1), min_size=1, max_size=8)):
            flipped[position // 8] ^= 1 << (position % 8)
        return bytes(flipped)
    header_end = 12 + int.from_bytes(body[4:12], "little")  # a length field: the header's or the tensors'
    at = draw(st.sampled_from([4, header_end]))
    size = draw(st.sampled_from([2**63, 2**64 - 1, 2**32, len(body), len(body) + 1, 0]))
    return body[:at] + size.to_bytes(8, "little") + body[at + 8:]
