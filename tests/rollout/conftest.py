"""Fixtures of the multi-turn tests: the tool toy's tokenizer, a tiny Qwen3 over it, and the transformers engine
running that model (each made once per test module)."""

from __future__ import annotations

import pytest
import torch

from arctic_rl.tasks.tool_toy import build_tool_tokenizer


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_tool_tokenizer()


def write_tiny_model_for(tokenizer, out):
    """The tiny Qwen3 (seed 0, float32) over ``tokenizer``, saved with it under ``out``; returns ``out``."""
    from arctic_rl.modules.models import build_causal_lm
    from arctic_rl.tasks.toy import tiny_qwen3_config

    torch.manual_seed(0)
    build_causal_lm(tiny_qwen3_config(len(tokenizer)), "float32").save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def transformers_engine(model_dir):
    """The transformers engine on ``model_dir``, shut down after the module (a fixture's body)."""
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

    engine = TransformersEngine(str(model_dir))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory, tool_tokenizer):
    return write_tiny_model_for(tool_tokenizer, tmp_path_factory.mktemp("tool_model"))


@pytest.fixture(scope="module")
def hf_engine(tool_model_dir):
    yield from transformers_engine(tool_model_dir)
