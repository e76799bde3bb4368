"""The loss and processor registries: built-ins against ``grpo_family_loss`` and hand-computed values,
registration rules, request errors, output checks, and plugins loaded from a real entry point."""

import math
import re
import sys

import pytest
import torch

from arctic_rl.modules.losses import GRPO_FAMILY, LossConfig, LossNormalizer, Regularizers, grpo_family_loss
from arctic_rl import loss_registry
from arctic_rl.loss_registry import LossInputError
from arctic_rl.serve import registry
from arctic_rl.serve.errors import RequestError, ServiceError
from tests.plugin_package import write_plugin
from arctic_rl.serve.registry import (
    ForwardContext,
    LossInputs,
    PluginError,
    compute_loss,
    get_loss,
    load_plugins,
    loss_needs,
    processor_needs,
    register_loss,
    register_processor,
    run_processor,
)


@pytest.fixture
def isolated(monkeypatch):
    """Registrations made in the test vanish after it."""
    loss_registry.get_loss("dapo")  # the built-ins are registered before the table is copied
    monkeypatch.setattr(loss_registry, "LOSSES", dict(loss_registry.LOSSES))
    monkeypatch.setattr(registry, "PROCESSORS", dict(registry.PROCESSORS))
    monkeypatch.setattr(loss_registry, "LOADED_PLUGINS", set())


def batch(seed: int = 0, n: int = 4, r: int = 5) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(r) < torch.tensor([r, 3, 1, 4]).unsqueeze(-1)).float()
    old = -torch.rand(n, r, generator=gen) * 2
    return dict(
        logprobs=(old + 0.3 * torch.randn(n, r, generator=gen)).requires_grad_(),
        old_logprobs=old,
        advantages=torch.randn(n, generator=gen),
        mask=mask,
        normalizer=LossNormalizer.of(mask, max_response_length=r),
        ref_logprobs=old + 0.1 * torch.randn(n, r, generator=gen),
        entropy=torch.rand(n, r, generator=gen),
        sampler_logprobs=old.clone(),
    )


def direct(name: str, config: dict, b: dict) -> tuple[torch.Tensor, dict]:
    reg_keys = ("kl_coef", "kl_estimator", "kl_bias_correction", "entropy_coef", "entropy_aggregation")
    regularizers = Regularizers(**{k: v for k, v in config.items() if k in reg_keys})
    loss_config = LossConfig(loss_type=name, **{k: v for k, v in config.items() if k not in reg_keys + ("loss_aggregation",)})
    return grpo_family_loss(loss_config, config.get("loss_aggregation") or loss_registry.get_loss(name).aggregation, regularizers,
                            b["logprobs"], b["old_logprobs"], b["advantages"], b["mask"], b["normalizer"],
                            b["ref_logprobs"] if regularizers.kl_coef > 0 else None,
                            b["entropy"] if regularizers.entropy_coef > 0 else None)


CONFIGS = [
    {},
    {"clip_high": 0.28, "dual_clip": 3},
    {"kl_coef": 0.05, "kl_estimator": "k2", "kl_bias_correction": False},
    {"kl_coef": 0.1, "entropy_coef": 0.01, "loss_aggregation": "sequence_sum"},
    {"kl_coef": 0.1, "kl_estimator": "low_var_kl+", "kl_bias_correction": False, "entropy_coef": 0.01,
     "entropy_aggregation": "loss"},
    {"entropy_coef": 0.02, "cispo_max_ratio": 2.0, "sapo_temperature_neg": 1.3, "vespo_k_neg": 2.5},
]


@pytest.mark.parametrize("name", sorted(GRPO_FAMILY))
@pytest.mark.parametrize("config", CONFIGS)
def test_builtin_losses_equal_grpo_family_loss(name, config):
    if name == "luspo":
        config = {**config, "importance_sampling_level": "sequence"}  # the pairing LUSPO is defined with
    b = batch()
    loss, stats = compute_loss(name, LossInputs(**b), config)
    want_loss, want_stats = direct(name, config, b)
    torch.testing.assert_close(loss, want_loss)
    assert stats.keys() == want_stats.keys()
    assert ("kl" in stats) == (config.get("kl_coef", 0) > 0)  # the reference enters only with kl_coef > 0
    for key in stats:
        torch.testing.assert_close(stats[key], want_stats[key])
    loss.backward()
    assert b["logprobs"].grad is not None and b["logprobs"].grad.abs().sum() > 0


def test_optional_inputs_enter_only_with_their_coefficient():
    b = batch(1)
    without = {**b, "ref_logprobs": None, "entropy": None}
    torch.testing.assert_close(compute_loss("grpo", LossInputs(**b), {})[0], compute_loss("grpo", LossInputs(**without), {})[0])
    with_entropy = compute_loss("grpo", LossInputs(**b), {"entropy_coef": 0.5})[0]
    assert not torch.allclose(with_entropy, compute_loss("grpo", LossInputs(**b), {})[0])


def test_dapo_by_hand():
    """Two sequences (3 real tokens), ratios e^0.1, e^0.5 (clipped to 1.2) for A=+1 and e^-0.5 (clipped to 0.8)
    for A=-1, a k3 KL of log ratio 0.2 on every token, entropy 1, 2, 3 on the real tokens."""
    old = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]])
    logprobs = (old + torch.tensor([[0.1, 0.5], [-0.5, 0.3]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    inputs = LossInputs(logprobs, old, torch.tensor([1.0, -1.0]), mask, LossNormalizer(3.0, 2.0, 2),
                        ref_logprobs=logprobs.detach() - 0.2, entropy=torch.tensor([[1.0, 2.0], [3.0, 9.0]]))
    config = {"kl_coef": 0.1, "kl_bias_correction": False, "entropy_coef": 0.01}
    loss, stats = compute_loss("dapo", inputs, config)
    policy = (-math.exp(0.1) - 1.2 + 0.8) / 3  # -min(rA, clip(r)A) per token, over the 3 tokens
    k3 = math.exp(-0.2) - 1 + 0.2
    assert loss.item() == pytest.approx(policy + 0.1 * k3 - 0.01 * (1 + 2 + 3) / 3, abs=1e-6)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(1 / 3)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(2 / 3)
    assert stats["kl"].item() == pytest.approx(k3, abs=1e-6)
    loss_plain, _ = compute_loss("dapo", inputs, {})
    assert loss_plain.item() == pytest.approx(policy, abs=1e-6)


@pytest.mark.parametrize("name, config, inputs_change, message", [
    ("dapo", {"clip_hi": 0.2}, {}, "loss 'dapo': unknown config key clip_hi; known: cispo_max_ratio, clip_high, clip_low, "),
    ("dapo", {"loss_type": "grpo"}, {}, "unknown config key loss_type"),
    ("dapo", {"clip_low": "0.2"}, {}, "loss 'dapo': config clip_low must be a finite number, got '0.2'"),
    ("dapo", {"clip_low": True}, {}, "config clip_low must be a finite number, got True"),
    ("dapo", {"clip_low": float("nan")}, {}, "config clip_low must be a finite number, got nan"),
    ("dapo", {"dual_clip": "x"}, {}, "config dual_clip must be a finite number or null, got 'x'"),
    ("dapo", {"dual_clip": 1.0}, {}, "loss 'dapo': config dual_clip must be > 1 (or None), got 1.0"),
    ("dapo", {"kl_estimator": "k4"}, {}, "config kl_estimator must be one of 'k1', 'k2', 'k3', 'abs', 'low_var_kl', 'k1+', 'k3+', "
                                                 "'abs+', 'low_var_kl+', got 'k4'"),
    ("dapo", {"entropy_aggregation": "seq"}, {}, "config entropy_aggregation must be one of 'token_mean', 'loss', got 'seq'"),
    ("dapo", {"kl_bias_correction": 1}, {}, "config kl_bias_correction must be true or false, got 1"),
    ("dapo", {"loss_aggregation": "mean"}, {}, "config loss_aggregation must be one of 'token_mean', "),
    ("dapo", {"importance_sampling_level": "seq"}, {}, "config importance_sampling_level must be one of 'token', 'sequence'"),
    ("dapo", {"kl_coef": -0.1}, {}, "loss 'dapo': config kl_coef must be >= 0, got -0.1"),
    ("dapo", {"entropy_coef": -0.1}, {}, "config entropy_coef must be >= 0"),
    ("grpo", {"kl_coef": 0.1}, {"ref_logprobs": None},
     "loss 'grpo': config kl_coef=0.1 needs ref_logprobs (it needs training.reference_model: true)"),
    ("grpo", {"entropy_coef": 0.1}, {"entropy": None}, "loss 'grpo': config entropy_coef=0.1 needs entropy"),
    ("grpo", ["clip_low"], {}, "loss 'grpo': loss config must be an object of named values, got a list"),
    # the built-ins, then whatever else this process registered (tinker.* once serve.tinker.losses is imported)
    ("ppo", {}, {}, "unknown loss 'ppo'; known: bnpo, cispo, dapo, dr_grpo, grpo, luspo, sapo, "),
    ("ppo", {}, {}, "vespo (plugins add more: entry point group 'arctic_rl.losses')"),
    (None, {}, {}, "loss name must be a string, got NoneType"),
])
def test_loss_request_errors_name_the_key(name, config, inputs_change, message):
    with pytest.raises(RequestError) as info:
        compute_loss(name, LossInputs(**{**batch(), **inputs_change}), config)
    assert message in str(info.value)


def test_loss_needs():
    assert loss_needs("dapo", {}) == set()
    assert loss_needs("dapo", {"kl_coef": 0.1, "entropy_coef": 0.0}) == {"ref_logprobs"}
    assert loss_needs("cispo", {"kl_coef": 0.1, "entropy_coef": 0.01}) == {"ref_logprobs", "entropy"}
    with pytest.raises(RequestError, match="unknown config key kl"):
        loss_needs("dapo", {"kl": 0.1})


@pytest.mark.parametrize("field, value, message", [
    ("mask", torch.ones(4), "mask: expected [n, R], got shape (4,)"),
    ("advantages", torch.ones(4, 1), "advantages: expected shape [4, 5] or [4], got [4, 1]"),
    ("old_logprobs", torch.ones(4, 6), "old_logprobs: expected shape [4, 5], got [4, 6]"),
    ("sampler_logprobs", torch.ones(3, 5), "sampler_logprobs: expected shape [4, 5], got [3, 5]"),
])
def test_loss_inputs_check_shapes(field, value, message):
    with pytest.raises(LossInputError) as info:  # the core's; the service never builds inputs of mismatched shapes
        LossInputs(**{**batch(), field: value})
    assert message in str(info.value)


def test_a_registered_loss(isolated):
    @register_loss("neg_entropy", needs=("entropy",))
    def neg_entropy(inputs: LossInputs, config: dict) -> tuple[torch.Tensor, dict]:
        value = -(inputs.entropy * inputs.mask).sum() / inputs.normalizer.num_tokens * config.get("scale", 1.0)
        return value, {"scale": torch.tensor(config.get("scale", 1.0))}

    b = batch()
    loss, stats = compute_loss("neg_entropy", LossInputs(**b), {"scale": 2.0})
    torch.testing.assert_close(loss, -2 * (b["entropy"] * b["mask"]).sum() / b["mask"].sum())
    assert loss_needs("neg_entropy", {}) == {"entropy"} and get_loss("neg_entropy").fn is neg_entropy
    with pytest.raises(RequestError, match="loss 'neg_entropy' needs entropy, which was not computed"):
        compute_loss("neg_entropy", LossInputs(**{**b, "entropy": None}), {})
    with pytest.raises(ValueError, match="loss 'neg_entropy' is already registered"):
        register_loss("neg_entropy")(neg_entropy)
    register_loss("neg_entropy", override=True)(lambda inputs, config: (torch.tensor(0.0), {}))
    assert compute_loss("neg_entropy", LossInputs(**b), {})[0].item() == 0.0 and loss_needs("neg_entropy", {}) == set()


@pytest.mark.parametrize("name, needs, override, message", [
    ("dapo", (), True, "loss 'dapo' is built in and cannot be replaced"),
    ("my loss", (), False, "loss name must be letters, digits, '_', '.' or '-', got 'my loss'"),
    ("ok", ("logits",), False, "loss 'ok': needs may only name entropy, ref_logprobs, got ['logits']"),
    ("ok", "entropy", False, "loss 'ok': needs must be a tuple of names, like ('entropy',)"),
])
def test_registration_errors(isolated, name, needs, override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        register_loss(name, needs=needs, override=override)(lambda inputs, config: (torch.tensor(0.0), {}))


@pytest.mark.parametrize("returned, message", [
    ((torch.zeros(2), {}), "loss 'bad' returned a tensor of shape [2] as its loss; expected a scalar tensor"),
    ((0.0, {}), "loss 'bad' returned a float as its loss"),
    ((torch.tensor(0.0), {"x": 1.0}), "loss 'bad' returned a dict as its stats; expected {name: tensor}"),
])
def test_a_loss_breaking_its_contract_is_a_service_error(isolated, returned, message):
    register_loss("bad")(lambda inputs, config: returned)
    with pytest.raises(ServiceError) as info:
        compute_loss("bad", LossInputs(**batch()), {})
    assert not isinstance(info.value, RequestError) and message in str(info.value)


def forward_context(with_ref: bool = True) -> ForwardContext:
    b = batch()
    return ForwardContext(b["logprobs"].detach(), b["entropy"], b["mask"], torch.randint(0, 9, (4, 5)),
                          b["ref_logprobs"] if with_ref else None)


def test_builtin_processors():
    ctx = forward_context()
    assert run_processor("logprobs", ctx)["logprobs"] is ctx.logprobs
    assert run_processor("entropy", ctx)["entropy"] is ctx.entropy
    assert run_processor("ref_logprobs", ctx)["ref_logprobs"] is ctx.ref_logprobs
    assert processor_needs("ref_logprobs") == {"ref_logprobs"} and processor_needs("entropy") == set()
    with pytest.raises(RequestError, match=r"processor 'ref_logprobs' needs ref_logprobs \(it needs training.reference_model: true\)"):
        run_processor("ref_logprobs", forward_context(with_ref=False))
    with pytest.raises(RequestError, match=r"processor 'ref_logprobs' needs training.reference_model: true"):
        registry.PROCESSORS["ref_logprobs"].fn(forward_context(with_ref=False))
    with pytest.raises(RequestError, match="unknown processor 'values'; known: entropy, logprobs, ref_logprobs"):
        run_processor("values", ctx)
    with pytest.raises(RequestError, match=r"response_ids: expected shape \[4, 5\], got \[4\]"):
        ForwardContext(ctx.logprobs, ctx.entropy, ctx.mask, torch.zeros(4))


def test_registered_processors_are_shape_checked(isolated):
    @register_processor("seq_logprob")
    def seq_logprob(ctx: ForwardContext) -> dict[str, torch.Tensor]:
        return {"seq_logprob": (ctx.logprobs * ctx.mask).sum(-1), "surprise": -ctx.logprobs}

    ctx = forward_context()
    out = run_processor("seq_logprob", ctx)
    assert out["seq_logprob"].shape == (4,) and out["surprise"].shape == (4, 5)
    register_processor("bad")(lambda ctx: {"x": ctx.logprobs[:, :2]})
    with pytest.raises(ServiceError, match=re.escape("processor 'bad' returned 'x': a tensor of shape [4, 2]; expected a tensor "
                                                     "of shape [4, 5] or [4]")):
        run_processor("bad", ctx)
    register_processor("worse", override=False)(lambda ctx: [ctx.logprobs])
    with pytest.raises(ServiceError, match="processor 'worse' returned a list"):
        run_processor("worse", ctx)
    with pytest.raises(ValueError, match="processor 'entropy' is built in"):
        register_processor("entropy", override=True)(seq_logprob)


@pytest.fixture
def plugin_path(tmp_path, monkeypatch, isolated):
    """A folder on sys.path for plugin distributions; their modules are forgotten afterwards."""
    before = set(sys.modules)
    monkeypatch.syspath_prepend(str(tmp_path))  # also invalidates import caches
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("arl_test_plugin"):
            del sys.modules[name]


def test_load_plugins_from_an_entry_point(plugin_path):
    write_plugin(plugin_path, "arl_test_plugin_ok", """
        [arctic_rl.losses]
        half_dapo = arl_test_plugin_ok.losses
        [arctic_rl.processors]
        token_count = arl_test_plugin_ok.processors
    """, {
        "losses": """
            from arctic_rl.serve.registry import compute_loss, register_loss

            @register_loss("half_dapo", needs=("entropy",))
            def half_dapo(inputs, config):
                loss, stats = compute_loss("dapo", inputs, config)
                return loss / 2, stats
        """,
        "processors": """
            from arctic_rl.serve.registry import register_processor

            @register_processor("token_count")
            def token_count(ctx):
                return {"token_count": ctx.mask.sum(-1)}
        """,
    })
    assert load_plugins() == ["arctic_rl.losses:half_dapo = arl_test_plugin_ok.losses",
                              "arctic_rl.processors:token_count = arl_test_plugin_ok.processors"]
    assert load_plugins() == []  # idempotent: nothing is imported (or registered) twice
    b = batch()
    torch.testing.assert_close(compute_loss("half_dapo", LossInputs(**b), {})[0], compute_loss("dapo", LossInputs(**b), {})[0] / 2)
    assert loss_needs("half_dapo", {}) == {"entropy"}
    torch.testing.assert_close(run_processor("token_count", forward_context())["token_count"], b["mask"].sum(-1))


@pytest.mark.parametrize("module_source, reason", [
    ("raise ImportError('no module named torch_extra')", "ImportError: no module named torch_extra"),
    ("from arctic_rl.serve.registry import register_loss\nregister_loss('dapo')(lambda i, c: None)",
     "ValueError: loss 'dapo' is built in and cannot be replaced"),
])
def test_a_failing_plugin_is_named(plugin_path, module_source, reason):
    write_plugin(plugin_path, "arl_test_plugin_bad", "[arctic_rl.losses]\nbroken = arl_test_plugin_bad.losses\n",
                 {"losses": module_source})
    with pytest.raises(PluginError) as info:
        load_plugins()
    assert str(info.value).startswith("plugin entry point arctic_rl.losses:broken = arl_test_plugin_bad.losses"
                                      " (from arl_test_plugin_bad) failed to load: ")
    assert reason in str(info.value)


def test_builtin_losses_take_the_mismatch_correction_and_off_policy_mask():
    """loss_config's vllm_importance_sampling_* and off_policy_mask_threshold (GRPOModule's, TRL's names) give
    grpo_family_loss the same PolicyWeights the module builds, from the request's sampler log-probs."""
    from arctic_rl.modules.corrections import PolicyWeights, off_policy_sequence_mask, sampler_importance_weights

    b = batch(2)
    b["sampler_logprobs"] = b["logprobs"].detach() + 0.1  # mean KL 0.1: sequences with A < 0 are dropped
    b["advantages"] = torch.tensor([0.5, -1.0, 0.3, -0.2])
    config = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_mask",
              "vllm_importance_sampling_clip_max": 1.1, "off_policy_mask_threshold": 0.05}
    loss, stats = compute_loss("dapo", LossInputs(**b), config)
    weights = PolicyWeights(importance=sampler_importance_weights(b["old_logprobs"], b["sampler_logprobs"], b["mask"], "token_mask", None, 1.1),
                            off_policy=off_policy_sequence_mask(b["advantages"], b["logprobs"], b["sampler_logprobs"], b["mask"], 0.05))
    assert 0 < (weights.importance * b["mask"]).count_nonzero() < b["mask"].sum() and weights.off_policy.sum() < 4  # both bite
    want, _ = grpo_family_loss(LossConfig(loss_type="dapo"), "token_mean", Regularizers(), b["logprobs"], b["old_logprobs"],
                               b["advantages"], b["mask"], b["normalizer"], weights=weights)
    torch.testing.assert_close(loss, want)
    assert stats["sampling/importance_sampling_ratio/max"].item() <= 1.1
    with pytest.raises(RequestError, match="need batch.sampler_logprobs"):
        compute_loss("dapo", LossInputs(**{**b, "sampler_logprobs": None}), config)
    with pytest.raises(RequestError, match="vllm_importance_sampling_mode must be one of"):
        compute_loss("dapo", LossInputs(**b), {"vllm_importance_sampling_mode": "token"})
    with pytest.raises(RequestError, match="loss 'vespo': config vllm_importance_sampling_mode must be token_truncate"):
        compute_loss("vespo", LossInputs(**b), {"vllm_importance_sampling_correction": True})
