"""The real service over HTTP (``arctic-rl serve``'s server process on loopback) at ZeRO stages 0 and 1:
save/load/export targets confined to folders the service wrote, states loaded without unpickling, client
mistakes answered 400 naming the field, retries that do not accumulate twice, and an http client that
takes its model from the server."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.serve import wire
from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.server import start_server_process
from arctic_rl.serve.targets import STATE_FILE
from arctic_rl.serve.transport import Message
from arctic_rl.strategies.safe_load import torch_files
from tests.serve.conftest import client_config
from tests.serve.test_core_requests import PROMPTS, sampled_batch

pytestmark = pytest.mark.slow


class Served:
    """A server process, an http client of it (without a model: the server's), and its root folder."""

    def __init__(self, server, client: ArcticRLClient, root: Path, stage: int):
        self.server, self.client, self.root, self.stage = server, client, root, stage

    def answer(self, op: str, meta: dict | None = None, tensors: dict | None = None, message: Message | None = None):
        """``(HTTP status, error message or None)`` of one raw request."""
        body = wire.encode(wire.Frame(op, message or Message(meta or {}, tensors or {})))
        headers = {"content-type": wire.CONTENT_TYPE, "authorization": f"Bearer {self.server.token}"}
        reply = httpx.post(f"{self.server.url}/v1/ops/{op}", content=body, headers=headers, timeout=120)
        return reply.status_code, (None if reply.status_code == 200 else reply.json()["message"])


@pytest.fixture(scope="module", params=[0, 1], ids=["zero0", "zero1"])
def served(request, tiny_model_dir, tmp_path_factory):
    stage = request.param
    root = tmp_path_factory.mktemp(f"root{stage}")
    config = client_config(tiny_model_dir, root, training={"zero_stage": stage}, engines={"engine": "transformers"})
    server = start_server_process(config, startup_timeout_s=600, env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    try:
        with ArcticRLClient(protocol="http", server_url=server.url, auth_token=server.token,
                            timeouts={"call_s": 120.0, "startup_s": 600.0}) as client:
            client.status()  # the job started
            yield Served(server, client, root, stage)
    finally:
        server.stop()


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a link's target, a folder, or a file's digest."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        out[rel] = (f"link:{os.readlink(path)}" if path.is_symlink() else "dir" if path.is_dir()
                    else hashlib.sha256(path.read_bytes()).hexdigest())
    return out


PATH_OPS = ("save_state", "export", "load_state")
LONG = "x" * 5000


@pytest.mark.parametrize("path, statuses", [
    (".", (403, 403, 403)),
    ("./", (403, 403, 403)),
    ("sub/..", (403, 403, 403)),
    ("<root>", (403, 403, 403)),  # the root's absolute path
    ("../outside", (403, 403, 403)),
    ("/tmp/arctic-rl-elsewhere", (403, 403, 403)),
    ("mine", (403, 403, 400)),  # a folder the service did not create
    ("notes.json", (403, 403, 400)),  # a file the service did not write
    ("notes.json/inner", (403, 403, 403)),
    (LONG, (400, 400, 400)),
])
def test_targets_the_service_did_not_write_are_refused_and_the_root_is_unchanged(served, path, statuses):
    (served.root / "mine").mkdir(exist_ok=True)
    (served.root / "mine" / "keep.txt").write_text("mine")
    (served.root / "notes.json").write_text('{"a": 1}')
    before, parent = snapshot(served.root), served.root.parent
    siblings = sorted(os.listdir(parent))
    requested = str(served.root) if path == "<root>" else path
    for op, status in zip(PATH_OPS, statuses):
        got, message = served.answer(op, {"path": requested})
        assert got == status, (op, message)
        assert "path" in message and str(served.root) not in message.replace(requested, "")  # the client's path only
    assert snapshot(served.root) == before
    assert served.root.is_dir() and not served.root.is_symlink()
    assert sorted(os.listdir(parent)) == siblings  # nothing written beside the root (ZeRO wrote .root.<hex> there)


def test_the_service_replaces_only_what_it_wrote_and_loads_only_states(served):
    client = served.client
    first = client.save_state("states/a")
    assert client.save_state("states/a") == first  # its own folder: replaced
    assert client.export("policy")["path"] == "policy" and client.export("policy")["path"] == "policy"
    assert served.answer("export", {"path": "states/a"}) == (403, "path 'states/a' holds a state the service wrote, not a "
                                                                  "export; name another path")
    assert served.answer("save_state", {"path": "policy"})[0] == 403
    assert served.answer("save_state", {"path": "states/a/inner"})[0] == 403
    status, message = served.answer("load_state", {"path": "policy"})
    assert status == 400 and message.startswith("path 'policy' is a folder save_state did not write, not a saved state")
    assert served.answer("load_state", {"path": "states/none"}) == (400, "path 'states/none': no saved state there")
    assert client.load_state("states/a") == {"path": "states/a", "step": first["step"]}


def planted(marker: Path):
    class Planted:
        def __reduce__(self):
            return open, (str(marker), "w")  # run on unpickling: creates the marker

    return {"torch": Planted()}


def test_a_planted_pickle_is_refused_not_run(served, tmp_path):
    """Every torch file of a saved state, replaced in turn by a pickle that runs code: load_state answers 400
    naming the file, runs nothing, and leaves the job as it was; the real state then loads."""
    client = served.client
    saved = client.save_state("states/planted")
    probe = TrainBatch.build([PROMPTS[0]] * 2, [[9, 10, 11], [12]], [1.0, -1.0])
    weights = client.forward(probe)["logprobs"]
    files = list(torch_files(served.root / "states" / "planted" / STATE_FILE))
    assert len(files) == (1 if served.stage == 0 else 3)  # ZeRO: model states, optimizer states, RNG state
    marker = tmp_path / "ran"
    for file in files:
        original = tmp_path / "original"
        shutil.copyfile(file, original)
        torch.save(planted(marker), file)
        status, message = served.answer("load_state", {"path": "states/planted"})
        shutil.copyfile(original, file)
        assert status == 400 and message.startswith("path 'states/planted' is not a state the service wrote: ")
        assert file.name in message and "weights_only" in message
        assert not marker.exists()
    torch.testing.assert_close(client.forward(probe)["logprobs"], weights, rtol=0, atol=0)
    assert client.load_state("states/planted")["step"] == saved["step"]


TINY_LR = 1e-12  # optimizer steps that keep the weights (to float precision): gradient norms stay comparable


def assert_nothing_accumulated(client: ArcticRLClient) -> None:
    """The next step's gradient is one batch's alone (refused requests left none behind). Measured with a real
    batch at every stage: ZeRO-1/2 cannot step without any gradient (DeepSpeed's IndexError)."""
    batch = sampled_batch(client, seed=8)
    client.forward_backward(batch)
    after_refusals = client.optim_step(lr=TINY_LR)["grad_norm"]
    client.forward_backward(batch)
    assert after_refusals == pytest.approx(client.optim_step(lr=TINY_LR)["grad_norm"], rel=1e-4)


def sampled_message(served: Served, **changes) -> Message:
    batch = sampled_batch(served.client, seed=3)
    for name, value in changes.items():
        setattr(batch, name, value)
    return batch.to_message({"loss": "dapo"})


@pytest.mark.parametrize("meta, field", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 2}, "top_p"),
])
def test_bad_sampling_parameters_are_400_naming_the_field(served, meta, field):
    status, message = served.answer("sample", {"prompts": [PROMPTS[0]], "n": 2, **meta})
    assert status == 400 and message.startswith(f"{field} must be"), message


def test_bad_forward_backward_requests_are_400_naming_the_field(served):
    n = 8
    empty = TrainBatch([PROMPTS[0]] * n, torch.zeros((n, 0), dtype=torch.long), torch.zeros((n, 0)), torch.ones(n))
    cases = {
        "batch.response_ids has width 0": empty.to_message({"loss": "dapo"}),
        "batch.response_mask is all zeros": sampled_message(served, response_mask=torch.zeros(n, 6),
                                                            response_ids=torch.ones((n, 6), dtype=torch.long),
                                                            sampler_logprobs=None),
        "loss 'dapo': config clip_high must be in [0, inf), got -1": None,
        "loss 'dapo': config clip_low must be in [0, 1), got 1.5": None,
    }
    for expected, message in cases.items():
        if message is None:
            key, value = ("clip_high", -1) if "clip_high" in expected else ("clip_low", 1.5)
            message = sampled_message(served)
            message.meta["loss_config"] = {key: value}
        status, error = served.answer("forward_backward", message=message)
        assert status == 400 and error.startswith(expected), error
    assert_nothing_accumulated(served.client)


@pytest.mark.parametrize("field, value", [("old_logprobs", -1e30), ("advantages", 3e38)])
def test_inputs_that_overflow_the_loss_are_named(served, field, value):
    batch = sampled_batch(served.client, seed=4)
    shape = batch.response_mask.shape if field != "advantages" else batch.advantages.shape
    setattr(batch, field, torch.full(shape, value))
    status, message = served.answer("forward_backward", message=batch.to_message({"loss": "dapo"}))
    assert status == 400 and f"batch.{field} (largest |value| {abs(value):.3g})" in message, message
    assert "rewards" not in message
    assert_nothing_accumulated(served.client)


def test_a_retried_request_with_its_request_id_runs_once(served):
    client, batch = served.client, sampled_batch(served.client, seed=6)
    tiny = TINY_LR
    first = client.forward_backward(batch, request_id="fb-1")
    retry = client.forward_backward(batch, request_id="fb-1")
    assert retry == {**first, "replayed": True}
    once = client.optim_step(lr=tiny)["grad_norm"]
    client.forward_backward(batch, request_id="fb-2")
    client.forward_backward(batch, request_id="fb-3")
    twice = client.optim_step(lr=tiny)["grad_norm"]
    assert twice == pytest.approx(2 * once, rel=1e-3)
    other = sampled_batch(served.client, seed=7).to_message({"loss": "dapo", "request_id": "fb-1"})
    status, message = served.answer("forward_backward", message=other)
    assert status == 400 and message.startswith("request_id 'fb-1' was already used for a different forward_backward")
    client.forward_backward(batch)  # ZeRO-1/2 cannot step without a gradient
    stepped = client.optim_step(lr=tiny, request_id="step-1")
    assert client.optim_step(lr=tiny, request_id="step-1") == {**stepped, "replayed": True}
    assert client.status()["step"] == stepped["step"]


def test_an_http_client_takes_the_servers_model_and_refuses_another(served, tiny_model_dir, tmp_path):
    url, token = served.server.url, served.server.token
    assert served.client.status()["model"] == str(tiny_model_dir)
    with ArcticRLClient(protocol="http", server_url=url, auth_token=token, model=str(tiny_model_dir)) as same:
        assert same.status()["model"] == str(tiny_model_dir)
    other = tmp_path / "other-model"
    other.mkdir()
    with ArcticRLClient(protocol="http", server_url=url, auth_token=token, model=str(other)) as wrong:
        expected = f"model: the client config names '{other}', but the server at {url} trains '{tiny_model_dir}'; leave model out"
        with pytest.raises(ConfigError, match="^" + re.escape(expected)):
            wrong.status()
