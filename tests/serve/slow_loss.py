"""The handler factory of the shutdown test: the real core (``ranks.ranked.build_handler``) with one plugin loss more,
``slow``, which marks that it started (``config["started_file"]``) and then sleeps ``config["seconds"]``: a
long operation, registered the way a user registers a loss."""

from __future__ import annotations

import time
from pathlib import Path

from arctic_rl.serve.ranks.ranked import build_handler
from arctic_rl.serve.registry import LossInputs, register_loss

FACTORY = "tests.serve.slow_loss:build"  # the shutdown test names it by this string (importing would register "slow" here)


@register_loss("slow")
def slow_loss(inputs: LossInputs, config: dict):
    Path(config["started_file"]).write_text("started")
    time.sleep(config["seconds"])
    return (inputs.logprobs * inputs.mask).sum() / inputs.normalizer.num_tokens, {}


def build(config: dict):
    return build_handler(config)
