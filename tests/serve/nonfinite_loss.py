"""The handler factory of the non-finite update tests: the real core (``ranks.ranked.build_handler``) with one plugin loss
more, ``infinite_gradient``: the token mean of the log-probs, finite, whose gradient is infinite (as an overflowing
term of a user's loss gives), registered the way a user registers a loss."""

from __future__ import annotations


import torch

from arctic_rl.serve.ranks.ranked import build_handler
from arctic_rl.serve.registry import LossInputs, register_loss
from tests.nonfinite import InfiniteGradient

FACTORY = "tests.serve.nonfinite_loss:build"  # a server names it by this string (importing registers the loss there)



@register_loss("infinite_gradient")
def infinite_gradient(inputs: LossInputs, config: dict):
    return InfiniteGradient.apply((inputs.logprobs * inputs.mask).sum() / inputs.normalizer.num_tokens), {}


def build(config: dict):
    return build_handler(config)
