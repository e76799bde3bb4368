"""``sample(max_staleness=k)``: a client that runs its own loop and never calls ``sync_weights`` gets completions from
weights at most ``k`` optimizer steps behind the trainer's: the service pushes them first when the engines are further
behind (``serve/lag.py``). Real parts: the service core with a transformers engine, through the client over ``local``
and ``http`` (a real server on loopback), and two training ranks; the versions are the ones the engines report with
each completion."""

from __future__ import annotations

import pytest

from arctic_rl.modules.advantages import group_advantages
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.errors import RequestError
from tests.serve.conftest import client_config

PROMPTS, G = [[9, 12, 15, 20], [10, 11, 30]], 4


def train_step(client: ArcticRLClient, out) -> dict:
    """One update on the samples ``out`` (a reward that prefers short completions, so the gradient is not zero)."""
    import torch

    rewards = torch.tensor([-float(len(c)) for per in out.token_ids for c in per])
    client.forward_backward(out.train_batch(group_advantages(rewards, G, "grpo", "group")), "dapo")
    return client.optim_step()


@pytest.mark.parametrize("protocol,devices", [("local", 1), ("http", 1), ("local", 2)])
def test_sampling_with_a_bound_syncs_only_when_the_engines_are_further_behind(protocol, devices, tiny_model_dir, tmp_path):
    """Two training ranks too (``RankedCore``: the sync it starts is every rank's collective)."""
    training = {"devices": devices, "zero_stage": 2 if devices > 1 else 0}
    config = client_config(tiny_model_dir, tmp_path, protocol=protocol, training=training, engines={"engine": "transformers"})
    with ArcticRLClient(config) as client:
        seen = []
        for step in range(5):
            out = client.sample(PROMPTS, n=G, max_tokens=6, seed=step, max_staleness=1)
            seen.append((client.status()["weights_behind"], {v for per in out.weight_versions for v in per}))
            train_step(client, out)
        # behind 0, 1 (within the bound), then 2 > 1: synced before sampling (behind 0, version 1), 1, then synced again
        assert seen == [(0, {0}), (1, {0}), (0, {1}), (1, {1}), (0, {2})]
        assert client.status()["weights_behind"] == 1
        out = client.sample(PROMPTS, n=G, max_tokens=6, seed=9)  # no bound: as they are
        assert {v for per in out.weight_versions for v in per} == {2}
        out = client.sample(PROMPTS, n=G, max_tokens=6, seed=9, max_staleness=0)
        assert {v for per in out.weight_versions for v in per} == {3} and client.status()["weights_behind"] == 0
        for bad in (-1, 1.5, True):
            with pytest.raises(RequestError, match="max_staleness must be"):
                client.sample(PROMPTS, n=G, max_tokens=6, max_staleness=bad)
