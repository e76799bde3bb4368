"""The ZeRO-stage rule the preflight applies: on one training process, stage 3 without parameter offload partitions
nothing and is reported (a warning, the run goes on); other stages, several processes, or offload are not."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest

from arctic_rl.preflight import check_zero_stage, wasted_zero_stage
from arctic_rl.strategies import ArcticStrategy


@pytest.mark.parametrize(("stage", "processes", "offload", "wasted"), [
    (3, 1, False, True), (3, 1, True, False), (3, 2, False, False), (1, 1, False, False), (2, 1, False, False)])
def test_the_rule(stage, processes, offload, wasted):
    why = wasted_zero_stage(stage, processes, offload)
    assert (why is not None) == wasted
    if wasted:
        assert "ArcticStrategy(stage=3) on one training process partitions nothing" in why and "offload_parameters" in why


@pytest.mark.parametrize(("kwargs", "warns"), [({"stage": 3}, True), ({"stage": 1}, False),
                                               ({"stage": 3, "offload_parameters": True}, False)])
def test_the_preflight_warns_for_a_trainer_on_one_device(kwargs, warns, tmp_path):
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ArcticStrategy(**kwargs), logger=False,
                         enable_checkpointing=False, default_root_dir=tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_zero_stage(trainer)
    messages = [str(w.message) for w in caught if "partitions nothing" in str(w.message)]
    assert len(messages) == (1 if warns else 0)
