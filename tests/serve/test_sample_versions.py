"""``sample``'s answer says which weight version produced each completion (``weight_versions``, flat on the wire,
``[prompt][sample]`` in the client's ``Samples``), and stays readable both ways across versions: a reply without it
(an older server) decodes to ``None``, and the fields an older client reads are unchanged."""

from __future__ import annotations

import torch

from arctic_rl.rollout.engines.base import Completion
from arctic_rl.serve.core import SampleOutput
from arctic_rl.weight_sync.base import GatherOnlySync
from arctic_rl.weight_sync.in_process import InProcessWeightSync


def output(versions: list[int | None]) -> SampleOutput:
    completions = [Completion([4, 5], [-0.5, -1.0], "stop", weight_version=versions[0]),
                   Completion([6], [-2.0], "length", weight_version=versions[1])]
    return SampleOutput([[1, 2], [3]], [completions[:1], completions[1:]], [["a"], ["b"]])


def test_versions_travel_flat_and_come_back_per_completion():
    message = output([3, 4]).to_message()
    assert torch.equal(message.tensors["weight_versions"], torch.tensor([3, 4]))
    assert set(message.tensors) == {"token_ids", "logprobs", "lengths", "prompt_ids", "prompt_lengths", "weight_versions"}
    back = SampleOutput.from_message(message)
    assert [[c.weight_version for c in per] for per in back.completions] == [[3], [4]]
    assert back.completions[1][0] == Completion([6], [-2.0], "length", weight_version=4)


def test_an_answer_without_versions_reads_as_unknown():
    message = output([None, 4]).to_message()  # one completion of unknown version: the field is left out
    assert "weight_versions" not in message.tensors
    assert [[c.weight_version for c in per] for per in SampleOutput.from_message(message).completions] == [[None], [None]]


def test_every_sync_bumps_the_version_the_engines_serve(tiny_model_dir):
    from arctic_rl.rollout.engines.factory import make_engine

    engine = make_engine("transformers", str(tiny_model_dir), dtype="float32", max_model_len=64, seed=0, device="cpu",
                         engine_kwargs={})
    sync = InProcessWeightSync(engine)
    assert sync.version == 0  # the start-up weights
    weights = {name: tensor.detach().clone() for name, tensor in engine.model.named_parameters()}
    for expected in (1, 2):
        sync.sync(iter([(name, tensor + expected) for name, tensor in weights.items()]))
        assert sync.version == expected
    assert all(torch.equal(engine.model.get_parameter(name), tensor + 2) for name, tensor in weights.items())
    gather_only = GatherOnlySync()  # a rank that sends nothing serves nothing new
    gather_only.sync(iter(weights.items()))
    assert gather_only.version == 0
