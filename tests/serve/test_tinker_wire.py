"""The Tinker SDK's wire formats as ``arctic-rl serve --api tinker`` reads them: sample requests (and which
stop conditions the engine can honour exactly), ``AdamParams`` with the SDK's defaults, ``tinker://`` paths,
and the protobuf ``ForwardBackwardRequest``/``ForwardBackwardOutput`` round trip through the SDK's own codecs."""

from __future__ import annotations

import numpy as np
import pytest

from arctic_rl.serve.tinker.batch import TinkerInputError
from arctic_rl.serve.tinker.wire import (adam_settings, checkpoint_path, forward_backward_output, parse_checkpoint,
                                         read_forward_backward, sample_arguments)

EOS = 2


def sample_request(**params) -> dict:
    return {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}, "num_samples": 3,
            "sampling_params": {"max_tokens": 4, "temperature": 0.5, "seed": 7, **params}}


def test_sample_request_becomes_the_cores_arguments():
    assert sample_arguments(sample_request(), EOS) == {
        "prompts": [[5, 6]], "n": 3, "stop_token_ids": [], "max_tokens": 4, "temperature": 0.5, "top_p": 1.0, "seed": 7}


def test_stop_tokens_are_served_when_they_include_end_of_sequence():
    assert sample_arguments(sample_request(stop=[EOS, 9, 9]), EOS)["stop_token_ids"] == [9]


@pytest.mark.parametrize(("stop", "why"), [([], "always stops at end-of-sequence"), ([9], "always stops at end-of-sequence"),
                                           (["\n\n"], "stop strings are not")])
def test_stop_conditions_the_engine_cannot_honour_are_refused(stop, why):
    with pytest.raises(TinkerInputError, match=why):
        sample_arguments(sample_request(stop=stop), EOS)


@pytest.mark.parametrize(("change", "message"), [
    ({"sampling_params": {"top_k": 5}}, "top_k=5 is not supported"),
    ({"prompt_logprobs": True}, "prompt_logprobs=True is not supported"),
    ({"topk_sample_logprobs": 2}, "topk_sample_logprobs=2 is not supported"),
    ({"prompt": {"chunks": [{"type": "image", "data": "x"}]}}, r"prompt.chunks\[0\]: 'image' chunks are not supported"),
    ({"surprise": 1}, r"unknown fields \['surprise'\]"),
])
def test_sample_refusals_name_the_field(change, message):
    with pytest.raises(TinkerInputError, match=message):
        sample_arguments({**sample_request(), **change}, EOS)


def test_adam_params_take_the_sdks_defaults():
    assert adam_settings({"adam_params": {"learning_rate": 0.01}}) == {
        "learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
    with pytest.raises(TinkerInputError, match="only AdamParams are supported"):
        adam_settings({"optimizer_params": {"type": "dimuon", "learning_rate": 0.01}})


def test_checkpoint_paths_round_trip_and_refuse_other_kinds():
    path = checkpoint_path("s:train:0", "weights", "step3")
    assert path == "tinker://s:train:0/weights/step3" and parse_checkpoint(path, "weights") == ("s:train:0", "step3")
    with pytest.raises(TinkerInputError, match="expected tinker://<model_id>/sampler_weights/<name>"):
        parse_checkpoint(path, "sampler_weights")


def test_forward_backward_protobuf_round_trip_through_the_sdk():
    """The SDK encodes a request; we read it. We encode an output; the SDK reads it."""
    tinker = pytest.importorskip("tinker")
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output

    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={
        "target_tokens": [6, 7, 8], "advantages": [0.0, 1.5, 1.5], "logprobs": [0.0, -1.0, -2.0]})
    request = tinker.types.ForwardBackwardRequest(
        forward_backward_input=tinker.types.ForwardBackwardInput(data=[datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.9}),
        model_id="m", seq_id=1)
    call = read_forward_backward(forward_backward_request_to_proto(request).SerializeToString())
    assert (call.model_id, call.loss_fn, call.loss_fn_config, call.forward_only) == ("m", "ppo", {"clip_low_threshold": 0.9}, False)
    d = call.datums[0]
    assert (d.tokens, d.targets, d.weights, d.advantages, d.logprobs) == ([5, 6, 7], [6, 7, 8], [1.0] * 3, [0, 1.5, 1.5], [0, -1, -2])
    out = deserialize_forward_backward_output(forward_backward_output(np.array([-1.0, -2.0, -3.0]), [2, 1], {"loss:sum": 2.5}))
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]] and out.metrics == {"loss:sum": 2.5}


def test_losses_and_inputs_the_sdk_has_but_arctic_rl_does_not_serve_are_refused():
    tinker = pytest.importorskip("tinker")
    from tinker.proto.request_conv import forward_backward_request_to_proto

    def body(loss_fn, **inputs):
        datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6]), loss_fn_inputs={"target_tokens": [6, 7], **inputs})
        request = tinker.types.ForwardBackwardRequest(forward_backward_input=tinker.types.ForwardBackwardInput(
            data=[datum], loss_fn=loss_fn), model_id="m", seq_id=1)
        return forward_backward_request_to_proto(request).SerializeToString()

    with pytest.raises(TinkerInputError, match="loss_fn 'stable_reinforce' is not supported by arctic-rl"):
        read_forward_backward(body("stable_reinforce"))
    with pytest.raises(TinkerInputError, match=r"loss_fn_inputs \['clip_low_threshold'\] are not inputs of 'ppo'"):
        read_forward_backward(body("ppo", advantages=[1.0, 1.0], logprobs=[-1.0, -1.0], clip_low_threshold=[0.5, 0.5]))
