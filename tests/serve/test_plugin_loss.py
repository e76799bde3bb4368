"""A plugin loss, installed as a package with an ``arctic_rl.losses`` entry point, chosen by name in ``fit``
(``model.init_args.loss.loss_type``, a real CLI run) and in the service (an in-process ``ArcticRLClient``'s
``forward_backward``): the one loss registry serves both front doors."""

from __future__ import annotations

import csv
import math

import pytest

from arctic_rl.errors import ConfigError
from arctic_rl.modules.losses import LossConfig
from tests.helpers import REPO, quickstart_config, run_cli
from tests.serve.conftest import client_config
from tests.plugin_package import installed_plugin

pytestmark = pytest.mark.slow


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The distribution ``arl_test_plugin_pg`` installed (``tests/plugin_package.py``); yields its marker file."""
    yield from installed_plugin(tmp_path, monkeypatch, REPO)


def test_a_plugin_loss_is_a_loss_type_of_fit(plugin, toy_task, tmp_path):
    with pytest.raises(ConfigError, match=r"loss_type must be one of \[.*'scaled_pg'.*\], got 'scaled_pgg' \(plugins add more"):
        LossConfig(loss_type="scaled_pgg")  # the plugin was loaded to list the names
    config = quickstart_config(toy_task, tmp_path, **{
        "model.init_args.loss.loss_type": "scaled_pg", "trainer.max_steps": 2, "data.init_args.batch_size": 4,
        "model.init_args.sampling.group_size": 4})
    config["trainer"]["callbacks"][0]["init_args"]["engine"] = "transformers"
    done = run_cli(config, tmp_path / "c.yaml", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = plugin.read_text().splitlines()
    assert len(calls) >= 2 and set(calls) == {"True"}  # every micro-batch of both steps, with the entropy it needs
    (metrics,) = (tmp_path / "logs").glob("version_*/metrics.csv")
    rows = [row for row in csv.DictReader(metrics.open()) if row.get("plugin/ratio_mean")]
    assert [float(row["plugin/ratio_mean"]) for row in rows] == [1.0, 1.0]  # its stat, logged at each step


def test_a_plugin_loss_is_served_by_name(plugin, tiny_model_dir, tmp_path):
    from arctic_rl.serve.batch import TrainBatch
    from arctic_rl.serve.client import ArcticRLClient
    from arctic_rl.serve.errors import RequestError

    responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    advantages = [1.0, -0.5, 0.25, 2.0]
    batch = TrainBatch.build([[3, 14, 9]] * 4, responses, advantages)
    config = client_config(tiny_model_dir, tmp_path / "root", engines={"engine": "transformers"})
    with ArcticRLClient(config) as client:
        out = client.forward_backward(batch, "scaled_pg", {"scale": 2.0})
        with pytest.raises(RequestError, match=r"unknown loss 'scaled_pgg'; known: .*scaled_pg"):
            client.forward_backward(batch, "scaled_pgg", {})
    tokens = sum(len(r) for r in responses)
    want = -2.0 * sum(a * len(r) for a, r in zip(advantages, responses)) / tokens
    assert out["loss"] == pytest.approx(want, rel=1e-6) and out["num_tokens"] == tokens
    assert out["plugin/ratio_mean"] == 1.0 and math.isfinite(out["entropy"])
    assert plugin.read_text().splitlines() == ["True"]  # one micro-batch, with the entropy it needs
