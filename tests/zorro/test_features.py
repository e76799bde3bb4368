"""Per-layer attention features resolved from real transformers models, and the guards that refuse
what the packed mask cannot express (statically, before any forward, or at the first layer call)."""

import pytest
import torch
from transformers import LlamaForCausalLM

from arctic_rl.zorro import ZorroUnsupportedModel, zorro_response_logprobs
from arctic_rl.zorro.features import AttentionFeatures, resolve_layer_features

from .models import WINDOW, build_tiny, make_batch

F = AttentionFeatures


@pytest.mark.parametrize("kind,expected", [
    ("llama", (F(), F())),
    ("qwen3", (F(), F())),
    ("mistral", (F(window=WINDOW), F(window=WINDOW))),  # config window, every layer
    ("phi3", (F(window=WINDOW), F(window=WINDOW))),
    ("phimoe", (F(window=WINDOW), F(window=WINDOW))),  # window only in the mask its forward builds
    ("qwen2", (F(), F(window=WINDOW))),  # use_sliding_window from max_window_layers on
    ("gemma2", (F(window=WINDOW, softcap=1.5), F(softcap=1.5))),
    ("gemma3_text", (F(window=WINDOW), F())),
    ("gpt_oss", (F(window=WINDOW, sinks=True), F(sinks=True))),
])
def test_features_of_each_family(kind, expected):
    assert resolve_layer_features(build_tiny(kind, attn_implementation="eager")) == expected


class WindowedLlama(LlamaForCausalLM):
    """A test-made family: a config window with a forward that builds no sliding-window mask."""


def test_config_window_without_a_known_mask_builder_is_refused():
    model = build_tiny("llama")
    model.config.sliding_window = 3
    tricky = WindowedLlama(model.config)
    with pytest.raises(ZorroUnsupportedModel, match=r"sliding_window=3 without layer_types.*create_sliding_window_causal_mask"):
        resolve_layer_features(tricky)


@pytest.mark.parametrize("change,match", [
    (dict(layer_types=["chunked_attention", "full_attention"]), r"\['chunked_attention'\] layers"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=None), "sliding_window=None"),
    (dict(is_causal=False), "bidirectionally"),
])
def test_unsupported_patterns_are_refused(change, match):
    model = build_tiny("qwen3")
    for key, value in change.items():
        setattr(model.config, key, value)
    prompts, ids, mask = make_batch([3], [0], [2])
    with pytest.raises(ZorroUnsupportedModel, match=f"model type 'qwen3'.*{match}"):
        zorro_response_logprobs(model, prompts, ids, mask, 1.0, False, 0)


def test_a_layer_window_that_differs_from_the_config_is_refused_at_the_first_call():
    """Qwen2 layers keep the window they were built with; a config edited afterwards disagrees."""
    model = build_tiny("qwen2")
    model.config.sliding_window = WINDOW + 1
    prompts, ids, mask = make_batch([6], [0], [2])
    with pytest.raises(ZorroUnsupportedModel, match=f"layer 1 passes sliding_window={WINDOW} but its config resolves to window {WINDOW + 1}"):
        zorro_response_logprobs(model, prompts, ids, mask, 1.0, False, 0)


def test_a_soft_cap_the_config_does_not_announce_is_refused():
    model = build_tiny("gemma2", attn_implementation="eager")
    for layer in model.model.layers:  # the modules cap at 1.5; the config now says no cap
        layer.self_attn.attn_logit_softcapping = 7.0
    prompts, ids, mask = make_batch([6], [0], [2])
    with pytest.raises(ZorroUnsupportedModel, match="layer 0 passes softcap=7.0 but its config resolves to window 4, soft-cap 1.5"):
        zorro_response_logprobs(model, prompts, ids, mask, 1.0, False, 0)


def test_describe():
    assert F().describe() == "full causal" and F().plain
    assert F(window=8, softcap=2.0, sinks=True).describe() == "window 8, soft-cap 2.0, attention sinks"
    assert not F(sinks=True).plain


def test_a_family_that_rebuilds_the_mask_inside_attention_is_refused():
    """Doge combines the mask with its own dynamic mask before attention: the packed mask never
    arrives, and the forward stops instead of returning results (no silent full-causal run)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("doge", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                  max_position_embeddings=64, pad_token_id=0)
    doge = AutoModelForCausalLM.from_config(config)
    prompts, ids, mask = make_batch([6], [0], [2])
    with pytest.raises(RuntimeError, match="model type 'doge': 0 of 2 attention layers received the packed ZoRRo mask"):
        zorro_response_logprobs(doge, prompts, ids, mask, 1.0, False, 0)
