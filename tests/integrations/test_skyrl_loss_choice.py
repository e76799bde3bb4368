"""The SkyRL backend's loss choice (``integrations/skyrl/loss_choice.py``: pure, no SkyRL import) with the test
plugin package installed: a Tinker ``loss_fn`` runs Tinker's own loss, a plugin loss of that name, or the plugin
loss the backend config's ``loss_fns`` routes it to; anything else is refused listing both. A routed request's
datums become a batch of 0/1 weights (``serve/tinker/batch.py``, ``registered``). ``integration_tests/skyrl`` runs
a routed plugin loss through SkyRL's own server and the ``tinker`` SDK."""

from __future__ import annotations

import pytest

from arctic_rl.integrations.skyrl.loss_choice import LossRoute, check_routes, choose_loss, tinker_losses
from arctic_rl.serve.tinker.batch import Datum, TinkerInputError, train_batch
from tests.helpers import REPO
from tests.plugin_package import installed_plugin

SKYRL_LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo", "gspo", "cispo", "ppo_critic", "dppo")  # SkyRL 0.4.0's


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The distribution ``arl_test_plugin_pg`` installed (``tests/plugin_package.py``); yields its marker file."""
    yield from installed_plugin(tmp_path, monkeypatch, REPO)


def test_each_loss_fn_finds_its_loss(plugin):
    routes = {"ppo": LossRoute(loss="scaled_pg", config={"scale": 2.0, "clip_low_threshold": 0.5})}
    assert choose_loss("ppo", {"clip_low_threshold": 0.7}, routes) == (
        "scaled_pg", {"scale": 2.0, "clip_low_threshold": 0.7}, False)  # the request's config over the route's
    assert choose_loss("ppo", None, {}) == ("tinker.ppo", {}, True)
    assert choose_loss("importance_sampling", None, routes) == ("tinker.importance_sampling", {}, True)
    assert choose_loss("scaled_pg", {"scale": 3.0}, {}) == ("scaled_pg", {"scale": 3.0}, False)
    assert choose_loss("dapo", None, {}) == ("dapo", {}, False)  # arctic-rl's built-ins are registered losses too
    assert sorted(tinker_losses()) == ["cispo", "cross_entropy", "dro", "importance_sampling", "ppo"]


def test_unknown_names_are_refused_listing_the_known_ones(plugin):
    with pytest.raises(ValueError, match=r"loss_fn 'gspo' is neither one of Tinker's losses arctic-rl serves \[.*'ppo'.*\] "
                                         r"nor a registered arctic-rl loss \[.*'scaled_pg'.*\] \(plugins add more"):
        choose_loss("gspo", None, {})
    with pytest.raises(ValueError, match=r"loss_fn 'tinker.ppo' is neither"):
        choose_loss("tinker.ppo", None, {})  # Tinker's losses go by their Tinker names
    check_routes({"gspo": LossRoute(loss="scaled_pg")}, SKYRL_LOSS_FNS)
    with pytest.raises(ValueError, match=r"loss_fns.gspo.loss='scaled_pgg' is not a registered arctic-rl loss; "
                                         r"known: \[.*'scaled_pg'.*\]"):
        check_routes({"gspo": LossRoute(loss="scaled_pgg")}, SKYRL_LOSS_FNS)
    with pytest.raises(ValueError, match=r"loss_fns.dro: SkyRL's API accepts the loss_fn names \["):
        check_routes({"dro": LossRoute(loss="scaled_pg")}, SKYRL_LOSS_FNS)
    with pytest.raises(ValueError, match="loss_fns.ppo.loss='tinker.cispo' is not a registered arctic-rl loss"):
        check_routes({"ppo": LossRoute(loss="tinker.cispo")}, SKYRL_LOSS_FNS)


def test_a_routed_requests_datums_keep_weights_as_a_mask():
    """Datum: prompt [1 2], targets [3 4 5 6] of weights 0, 1, 0, 1 (a hole: an observation), advantages kept per
    token (not folded into weights, unlike Tinker's linear losses)."""
    d = Datum(tokens=[1, 2, 3, 4, 5], targets=[2, 3, 4, 5, 6], weights=[0, 1, 0, 1, 0],
              advantages=[0.0, 0.5, 0.0, -1.5, 0.0], logprobs=[0.0, -0.1, -0.2, -0.3, -0.4])
    batch = train_batch([d], "ppo", registered=True)
    assert batch.prompt_token_ids == [[1, 2]] and batch.response_ids.tolist() == [[3, 4, 5]]
    assert batch.response_mask.tolist() == [[1, 0, 1]]
    assert batch.advantages.tolist() == [[0.5, 0.0, -1.5]] and batch.sampler_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    with pytest.raises(TinkerInputError, match=r"datum 0: loss_fn_inputs.weights\[3\] = 0.5; a registered arctic-rl loss "
                                               "takes weights 0 and 1"):
        train_batch([Datum(**{**vars(d), "weights": [0, 1, 0, 0.5, 0]})], "ppo", registered=True)
    with pytest.raises(TinkerInputError, match=r"datum 0: loss_fn 'cross_entropy' needs loss_fn_inputs.advantages"):
        train_batch([Datum(**{**vars(d), "advantages": []})], "cross_entropy", registered=True)
