"""A training rank that dies under a 2-rank service: the call's ``JobFailed`` names that rank and how it ended,
not another rank's broken collective (real rank processes, DeepSpeed ZeRO-2, the tiny Qwen3 on CPU)."""

from __future__ import annotations

import os
import signal

import pytest

from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.errors import JobFailed
from tests.serve.conftest import client_config


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_rank_is_named_with_its_signal(tiny_model_dir, tmp_path):
    config = client_config(tiny_model_dir, tmp_path / "root", training={"devices": 2, "zero_stage": 2},
                           engines={"engine": "transformers"})
    with ArcticRLClient(config) as client:
        pids = client.status()["rank_pids"]
        batch = TrainBatch.build([[1, 2], [1, 3]], [[3, 4], [5, 6]], [1.0, -1.0])
        client.forward_backward(batch, "dapo")
        os.kill(pids[1], signal.SIGKILL)  # a rank process this test's client started
        with pytest.raises(JobFailed) as failed:
            client.forward_backward(batch, "dapo")
        assert str(failed.value).startswith(
            "the training job was ended: training rank 1 died during forward_backward (killed by SIGKILL)"), str(failed.value)
