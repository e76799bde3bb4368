"""``openai_service``: the OpenAI-compatible endpoint (``arctic_rl.rollout.openai``) over the service's core, with the
tokenizer and sampling limits of the core's config."""

from __future__ import annotations

from arctic_rl.errors import ConfigError
from arctic_rl.rollout.openai.service import OpenAIService, Sampled  # noqa: F401  (the endpoint's types, re-exported)
from arctic_rl.serve.operations import Operations


def openai_service(core: Operations) -> OpenAIService:
    """The service over ``core``, with the tokenizer its config names (``tokenizer``, else ``model``) and its
    sampling limits."""
    from transformers import AutoTokenizer

    config = core.config
    source = config.tokenizer or config.model
    if not isinstance(source, str):
        raise ConfigError("--api openai needs a tokenizer: set the config's tokenizer (the model is a config dict)")
    name = config.model if isinstance(config.model, str) else "arctic-rl"
    return OpenAIService(core, AutoTokenizer.from_pretrained(source), name, config.sampling.max_prompt_length,
                         config.sampling.max_response_length)
