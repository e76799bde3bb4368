"""``corrections.router_replay`` through ``fit``: a tiny Qwen3-MoE quickstart where the transformers engine records each
token's experts, the rollout batch carries them, and the policy's forwards (selective checkpointing's recompute too)
replay them; the step logs the routing mismatch. vLLM is refused before anything starts."""

from __future__ import annotations

import math

import pytest

from arctic_rl.cli import build_cli
from arctic_rl.errors import ConfigError
from tests.helpers import quickstart_config, write_config

MOE = {"model_type": "qwen3_moe", "vocab_size": 33, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
       "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
       "head_dim": 16, "max_position_embeddings": 128, "tie_word_embeddings": True}


def moe_config(toy_task, tmp_path, engine: str) -> dict:
    return quickstart_config(toy_task, tmp_path, engine=engine, **{
        "trainer.max_steps": 2, "data.init_args.batch_size": 4, "model.init_args.sampling.group_size": 4,
        "model.init_args.model": MOE, "model.init_args.corrections.router_replay": True,
        "model.init_args.compute.gradient_checkpointing": "selective",
    })


def test_fit_replays_the_engine_routing(toy_task, tmp_path):
    cli = build_cli(["--config", str(write_config(moe_config(toy_task, tmp_path, "transformers"), tmp_path / "c.yaml"))], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    metrics = cli.trainer.callback_metrics
    assert cli.trainer.global_step == 2 and math.isfinite(float(metrics["loss"]))
    assert 0.0 <= float(metrics["router/mismatch"]) <= float(metrics["router/mismatch_tokens"]) <= 1.0
    assert float(metrics["sampler_logprob_diff"]) < 1e-5  # the engine holds the trainer's weights; replay routes as it did


def test_vllm_is_refused_before_anything_starts(toy_task, tmp_path):
    cli = build_cli(["--config", str(write_config(moe_config(toy_task, tmp_path, "vllm"), tmp_path / "c.yaml"))], run=False)
    with pytest.raises(ConfigError, match="router_replay with RolloutCallback.engine 'vllm'.*Model Runner V2"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
