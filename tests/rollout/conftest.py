"""Fixtures of the multi-turn tests: the tool toy's tokenizer, a tiny Qwen3 over it, and the transformers engine
running that model (each made once per test module)."""

from __future__ import annotations

import pytest
import torch

from arctic_rl.tasks.tool_toy import build_tool_tokenizer


@pytest.fixture(scope="module")
def tool_tokenizer():
    return build_tool_tokenizer()


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory, tool_tokenizer):
    from arctic_rl.modules.models import build_causal_lm
    from arctic_rl.tasks.toy import tiny_qwen3_config

    out = tmp_path_factory.mktemp("tool_model")
    torch.manual_seed(0)
    build_causal_lm(tiny_qwen3_config(len(tool_tokenizer)), "float32").save_pretrained(out)
    tool_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def hf_engine(tool_model_dir):
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

    engine = TransformersEngine(str(tool_model_dir))
    yield engine
    engine.shutdown()
