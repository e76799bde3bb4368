"""The broadcast transport's two ends (``send_buckets``, ``receive_buckets``) over a real gloo group of two ranks in
this process (the sender here, the receiver in a thread): what arrives equals what was sent, a stable source goes
from where it lies, a volatile one (a ZeRO-3 gather reusing its storage) is copied before it changes, and a receiver
offering its own tensors gets them filled in place."""

from __future__ import annotations

import threading

import pytest
import torch

from arctic_rl.weight_sync.broadcast import GroupAddress, join_group, receive_buckets, send_buckets, serve_store

TIMEOUT_S = 60.0


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"embed": (50, 16), "norm": (16,), "q": (16, 16), "big": (64, 64), "head": (50, 16)}
    tensors = [(name, torch.randn(shape, generator=generator)) for name, shape in shapes.items()]
    return tensors + [("ids", torch.arange(7, dtype=torch.int64))]  # a dtype change starts a new bucket


def run_sync(items, *, stable: bool, own: dict[str, torch.Tensor] | None = None, bucket_bytes: int = 4096, syncs: int = 1):
    """Send ``items()`` ``syncs`` times to a receiver offering the tensors ``own`` (by name) as targets; returns the
    receiver's ``(name, tensor)`` lists (clones, except a tensor of ``own``, kept as itself) and the sender's
    ``(bytes, tensors)`` of the last sync."""
    own = own or {}
    store = serve_store("127.0.0.1", 2, TIMEOUT_S)
    address = GroupAddress("127.0.0.1", store.port, 2, "gloo", TIMEOUT_S)
    received: list[list[tuple[str, torch.Tensor]]] = []
    errors: list[BaseException] = []

    def receiver() -> None:
        try:
            _, group = join_group(address, 1, torch.device("cpu"))
            for sync_id in range(1, syncs + 1):
                got = []
                for name, tensor in receive_buckets(group, sync_id, torch.device("cpu"), TIMEOUT_S, own.get):
                    got.append((name, tensor if tensor is own.get(name) else tensor.clone()))
                received.append(got)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=receiver, daemon=True)
    thread.start()
    _, group = join_group(address, 0, torch.device("cpu"), store)
    for sync_id in range(1, syncs + 1):
        sent = send_buckets(group, sync_id, items(), bucket_bytes, torch.device("cpu"), TIMEOUT_S, stable=stable)
    thread.join(TIMEOUT_S)
    assert not errors, errors
    assert not thread.is_alive()
    return received, sent


@pytest.mark.parametrize("stable", [True, False])
def test_every_tensor_arrives_equal_in_order(stable):
    tensors = named_tensors()
    [got], (nbytes, count) = run_sync(lambda: iter(tensors), stable=stable)
    assert [name for name, _ in got] == [name for name, _ in tensors]
    for (_, want), (_, have) in zip(tensors, got):
        assert have.dtype == want.dtype and torch.equal(have, want)
    assert count == len(tensors) and nbytes == sum(t.numel() * t.element_size() for _, t in tensors)


def test_a_gather_that_reuses_its_storage_arrives_intact_when_not_stable():
    """A ZeRO-3 gather's tensor is valid only until the next is requested: here every tensor is yielded from one
    scratch buffer, overwritten by the next. Sent as not stable, each is packed before it changes."""
    tensors = [(n, t) for n, t in named_tensors() if t.dtype == torch.float32]
    scratch = torch.empty(max(t.numel() for _, t in tensors))

    def gathered():
        for name, tensor in tensors:
            view = scratch[: tensor.numel()].view(tensor.shape)
            view.copy_(tensor)
            yield name, view
        scratch.fill_(float("nan"))  # the gather's storage freed and reused

    [got], _ = run_sync(gathered, stable=False, bucket_bytes=1 << 20)  # one bucket: all of it in flight at once
    for (_, want), (_, have) in zip(tensors, got):
        assert torch.equal(have, want)


def test_tensors_go_straight_into_the_receivers_own_where_it_offers_them():
    """The engine's parameters as targets (``ReceivesInPlace``): each is received into and yielded as itself, over two
    syncs; a target of another shape or dtype is not used (that tensor comes in a buffer), nor is a missing one."""
    tensors = named_tensors()
    own = {name: torch.zeros_like(t) for name, t in tensors if name not in ("norm", "ids")}
    own["q"] = torch.zeros(8, 32)  # wrong shape: not received into
    own["head"] = torch.zeros(50, 16, dtype=torch.float64)  # wrong dtype: not received into
    addresses = {name: t.data_ptr() for name, t in own.items()}
    received, _ = run_sync(lambda: iter(tensors), stable=True, own=own, syncs=2)
    for got in received:
        by_name = dict(got)
        for name, want in tensors:
            assert torch.equal(by_name[name], want), name
        for name in ("embed", "big"):
            assert by_name[name] is own[name] and own[name].data_ptr() == addresses[name]
        for name in ("q", "head", "norm", "ids"):
            assert name not in own or by_name[name] is not own[name]
    assert not own["q"].any() and not own["head"].any()  # left alone
