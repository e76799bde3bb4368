"""The table of engine kinds (``rollout/engines/kinds.py``) is what the rollout callback, the service config and the
factory accept, and the broadcast-receiving capability is a Protocol an engine is seen through."""

from __future__ import annotations

import typing

import pytest

from arctic_rl.rollout.callback import RolloutCallback
from arctic_rl.rollout.engines.base import ReceivesBroadcastWeights
from arctic_rl.rollout.engines.factory import make_engine
from arctic_rl.rollout.engines.kinds import ENGINE_CHOICES, ENGINES, EngineChoice
from arctic_rl.serve.config import EnginesConfig


def test_every_front_door_takes_exactly_the_tables_engine_kinds():
    assert ENGINE_CHOICES == ("auto", "vllm", "transformers") == ("auto", *ENGINES)
    assert typing.get_args(EngineChoice) == ENGINE_CHOICES
    assert typing.get_type_hints(RolloutCallback.__init__)["engine"] == EngineChoice
    assert EnginesConfig.model_json_schema()["properties"]["engine"]["enum"] == list(ENGINE_CHOICES)


@pytest.mark.parametrize("start", [lambda: RolloutCallback(engine="sglang"),
                                   lambda: make_engine("sglang", "unused", dtype="float32", max_model_len=8, seed=0,
                                                       device="cpu", engine_kwargs={})])
def test_an_unknown_kind_is_refused_with_the_tables_names(start):
    with pytest.raises(ValueError, match=r"RolloutCallback.engine must be one of 'auto', 'vllm', 'transformers', got 'sglang'"):
        start()


def test_each_kind_names_a_class_that_exists():
    for kind in ENGINES.values():
        if kind.available():
            assert kind.engine_class().__name__ == kind.cls


class OwnReceivers:  # stand-in shaped like an engine whose workers receive broadcasts themselves (e.g. vLLM's)
    num_weight_receivers = 2

    def join_weight_group(self, address, base_rank: int) -> list[int]:
        return [base_rank, base_rank + 1]

    def receive_weights(self, sync_id: int) -> int:
        return 0


class FedByItsHolder:  # stand-in shaped like the transformers engine: update_weights only
    def update_weights(self, named_tensors) -> None:
        pass


def test_the_broadcast_capability_is_a_protocol_not_a_probe():
    assert isinstance(OwnReceivers(), ReceivesBroadcastWeights)
    assert not isinstance(FedByItsHolder(), ReceivesBroadcastWeights)
    from arctic_rl.rollout.engines.vllm.engine import VLLMEngine
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

    members = ("num_weight_receivers", "join_weight_group", "receive_weights")
    assert all(hasattr(VLLMEngine, m) for m in members)
    assert not any(hasattr(TransformersEngine, m) for m in members)
