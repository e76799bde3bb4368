"""The one operations contract (``serve/operations.py``): the core, the ranked core and the client implement all of
it, a class missing an operation fails where it is defined, and ``CoreHandler`` dispatches by its method names
(a real, unstarted ``ServiceCore``: nothing here builds a model)."""

from __future__ import annotations

import pytest

from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.config import ArcticRLClientConfig
from arctic_rl.serve.core import PathOperations, ServiceCore
from arctic_rl.serve.errors import RequestError, UnknownOperation
from arctic_rl.serve.operations import OPERATIONS, Operations
from arctic_rl.serve.ops import CoreHandler
from arctic_rl.serve.ranks.ranked import RankedCore
from arctic_rl.serve.transport import Message
from tests.serve.conftest import client_config

NAMES = ("sample", "forward", "forward_backward", "optim_step", "zero_grad", "sync_weights", "sleep", "wake",
         "save_state", "load_state", "export", "status")


def test_the_operations_are_the_contracts_abstract_methods_in_order():
    assert OPERATIONS == NAMES
    assert Operations.__abstractmethods__ == frozenset(NAMES + ("close",))


@pytest.mark.parametrize("implementation", [ServiceCore, RankedCore, ArcticRLClient])
def test_the_cores_and_the_client_implement_every_operation(implementation):
    assert issubclass(implementation, Operations)
    assert implementation.__abstractmethods__ == frozenset()


def test_a_class_missing_an_operation_fails_where_it_is_defined():
    with pytest.raises(TypeError) as missing:
        class HalfCore(Operations):  # noqa: F841
            def sample(self, prompts, n=1, max_tokens=None, temperature=1.0, top_p=1.0, seed=None, prompt_seeds=None,
                       timeout_s=None, stop_token_ids=()):
                return None

    assert str(missing.value) == ("HalfCore implements Operations but not forward, forward_backward, optim_step, zero_grad, "
                                  "sync_weights, sleep, wake, save_state, load_state, export, status, close; define them, "
                                  "or declare the class with abstract=True")


def test_a_partial_base_says_so_and_its_subclasses_are_still_checked():
    class Paths(PathOperations, abstract=True):  # save_state, load_state and export, through _path_call
        pass

    with pytest.raises(TypeError, match=r"^Core implements Operations but not status; define it, or declare"):
        class Core(Paths):  # noqa: F841
            def _path_call(self, name, path, timeout_s):
                return {}

            sample = forward = forward_backward = optim_step = zero_grad = sync_weights = sleep = wake = close = _path_call


@pytest.fixture
def handler(tiny_model_dir, tmp_path):
    handler = CoreHandler(ServiceCore(ArcticRLClientConfig.load(client_config(tiny_model_dir, tmp_path))))
    yield handler
    assert not handler.core.started  # every request below was refused before the job started
    handler.close()


@pytest.mark.parametrize("op", ["format_disk", "close", "start", "_path_call"])
def test_an_unknown_operation_is_refused_naming_the_known_ones(handler, op):
    with pytest.raises(UnknownOperation) as refused:
        handler.call(op, Message())
    assert str(refused.value) == (f"unknown operation {op!r}; known: ['sample', 'forward', 'forward_backward', 'optim_step', "
                                  "'zero_grad', 'sync_weights', 'sleep', 'wake', 'save_state', 'load_state', 'export', 'status']")


@pytest.mark.parametrize(("op", "meta", "message"), [
    ("zero_grad", {"x": 1}, "zero_grad: unknown fields ['x']; known: []"),
    ("status", {"verbose": True}, "status: unknown fields ['verbose']; known: []"),
    ("sample", {}, "prompts is required"),
    ("forward_backward", {"loss": "dapo", "steps": 2}, "forward_backward: unknown fields ['steps']; known: "
                                                       "['loss', 'loss_config', 'processors', 'request_id']"),
    ("export", {}, "path is required"),
])
def test_each_operation_is_decoded_by_its_own_entry(handler, op, meta, message):
    with pytest.raises(RequestError) as refused:
        handler.call(op, Message(meta))
    assert str(refused.value) == message


def test_the_handler_serves_only_an_operations():
    with pytest.raises(TypeError, match="CoreHandler serves an Operations"):
        CoreHandler(object())
