"""``ArcticGRPOTrainer`` against TRL's own ``GRPOTrainer`` (TRL 1.16, real, on CPU): the same seed, tiny
Qwen3 and dataset give the same completions, losses, gradient norms, metrics and weights for 3 steps
(a fresh on-policy step, an off-policy step of ``num_iterations=2`` with clipping and KL, a new
generation from the updated weights), with ZoRRo's dedup counts logged; its log-probs equal the
model's own forward. A plugin loss, installed as a package, is a ``loss_type`` too."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from arctic_rl.integrations.trl import ArcticGRPOTrainer  # noqa: E402
from arctic_rl.tasks.toy import echo_score, make_rows  # noqa: E402
from arctic_rl.integrations.trl_mapping import loss_settings  # noqa: E402
from tests.helpers import REPO, cli_env  # noqa: E402
from tests.plugin_package import installed_plugin  # noqa: E402

COMPARED = ("loss", "grad_norm", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
ZORRO_METRICS = ("zorro/naive_tokens", "zorro/processed_tokens", "zorro/dedup_ratio")


def run_grpo(trainer_cls, model_dir, out_dir, **config):
    """3 steps of ``trainer_cls`` on 2 prompts x 4 completions per step; the log history (one dict per
    step) and every completion the reward function saw, in order."""
    seen: list[list[str]] = []

    def echo_reward(prompts, completions, answer, **columns):
        seen.append(list(completions))
        return [echo_score(c, a) for c, a in zip(completions, answer)]

    args = GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        max_steps=3, logging_steps=1, seed=0, optim="sgd", learning_rate=0.1,  # SGD: weight gaps stay linear in gradient gaps
        report_to=[], use_cpu=True, bf16=False,
        save_strategy="no", disable_tqdm=True, **config,
    )
    trainer = trainer_cls(model=str(model_dir), reward_funcs=echo_reward, args=args,
                          train_dataset=Dataset.from_list(make_rows(8, 0)))
    trainer.train()
    return trainer, [h for h in trainer.state.log_history if "loss" in h], seen


CASES = {
    "dapo_kl": dict(loss_type="dapo", beta=0.05, num_iterations=2),
    "grpo_sequence": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.1, num_iterations=2),
    "trl_loss_top_entropy": dict(loss_type="bnpo", top_entropy_quantile=0.5, num_iterations=2),  # outside our family
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_run_as_trls_grpo_trainer(case, tiny_model_dir, tmp_path):
    config = CASES[case]
    trl_trainer, trl_log, trl_seen = run_grpo(GRPOTrainer, tiny_model_dir, tmp_path / "trl", **config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, our_log, our_seen = run_grpo(ArcticGRPOTrainer, tiny_model_dir, tmp_path / "arctic", **config)
    fallback = [str(w.message) for w in caught if "not in arctic-rl's loss family" in str(w.message)]
    assert bool(fallback) == (case == "trl_loss_top_entropy"), fallback
    assert our_seen == trl_seen  # same completions at every step (generation is TRL's, from identical weights)
    assert len(our_log) == len(trl_log) == 3
    tokens_before = 0.0
    for step, (theirs, mine) in enumerate(zip(trl_log, our_log), start=1):
        for key in COMPARED:
            if key in theirs:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (step, key)
        assert mine.get("reward") == theirs.get("reward")  # logged on generation steps
        # ZoRRo's counts: the naive count is TRL's own token count of the batch, the processed one smaller
        assert all(name in mine for name in ZORRO_METRICS), sorted(mine)
        assert mine["zorro/naive_tokens"] == theirs.get("num_tokens", tokens_before + mine["zorro/naive_tokens"]) - tokens_before
        assert mine["zorro/processed_tokens"] < mine["zorro/naive_tokens"] and mine["zorro/dedup_ratio"] > 1.0
        tokens_before = theirs.get("num_tokens", tokens_before)
    assert ("kl" in our_log[1]) == bool(config.get("beta"))  # the KL term ran where configured
    for (name, theirs), mine in zip(trl_trainer.model.named_parameters(), ours.model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def arctic_trainer(tiny_model_dir, tmp_path_factory):
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, temperature=0.7, report_to=[], use_cpu=True, bf16=False)
    return ArcticGRPOTrainer(model=str(tiny_model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                             args=args, train_dataset=Dataset.from_list(make_rows(4, 0)))


def test_logprobs_equal_the_models_own_forward(arctic_trainer, tiny_model_dir):
    """TRL's layout (left-padded prompts, two sharing one, right-padded completions) through the override,
    in chunks of 2 rows, against ``model(ids).logits`` of each unpadded sequence at TRL's temperature."""
    prompts = [[7, 12, 4], [7, 12, 4], [9, 20], [15, 16, 17, 18]]
    completions = [[10, 11, 12], [10, 13, 2], [14], [19, 20]]
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.tensor([[0] * (width_p - len(p)) + p + c + [0] * (width_c - len(c)) for p, c in zip(prompts, completions)])
    mask = torch.tensor([[0] * (width_p - len(p)) + [1] * (len(p) + len(c)) + [0] * (width_c - len(c))
                         for p, c in zip(prompts, completions)])
    with torch.no_grad():
        logps, entropy, aux = arctic_trainer._get_per_token_logps_and_entropies(
            arctic_trainer.model, ids, mask, width_c, batch_size=2, compute_entropy=True)
    assert aux is None and logps.shape == entropy.shape == (4, width_c)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for i, (p, c) in enumerate(zip(prompts, completions)):
        with torch.no_grad():
            logits = reference(torch.tensor([p + c])).logits[0, len(p) - 1 : -1].double() / 0.7
        expected = logits.log_softmax(-1)
        torch.testing.assert_close(logps[i, : len(c)].double(), expected.gather(-1, torch.tensor(c)[:, None])[:, 0], rtol=0, atol=2e-5)
        torch.testing.assert_close(entropy[i, : len(c)].double(), -(expected.exp() * expected).sum(-1), rtol=0, atol=2e-5)
        assert not logps[i, len(c):].any()


def test_bad_input_is_refused_by_name(arctic_trainer):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ArcticGRPOTrainer(model="unused", attention_backend="flash")
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"text-only; got multimodal inputs \['pixel_values'\]"):
        arctic_trainer._get_per_token_logps_and_entropies(arctic_trainer.model, ids, mask, 1, pixel_values=torch.zeros(1, 3))


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The distribution ``arl_test_plugin_pg`` installed (``tests/plugin_package.py``); yields its marker file."""
    yield from installed_plugin(tmp_path, monkeypatch, REPO)


def test_a_plugin_loss_is_a_loss_type(plugin, tiny_model_dir, tmp_path):
    """``loss_type`` names the installed plugin's ``scaled_pg``. On-policy (ratio 1) at its default scale 1 it is dapo's
    loss under dapo's normaliser, so 3 steps give a ``dapo`` run's completions, losses, gradient norms and weights;
    it computed every micro-batch, with the entropy it needs, and its stat is logged."""
    dapo, dapo_log, dapo_seen = run_grpo(ArcticGRPOTrainer, tiny_model_dir, tmp_path / "dapo", loss_type="dapo")
    assert not plugin.exists()  # dapo's run never called the plugin
    ours, our_log, our_seen = run_grpo(ArcticGRPOTrainer, tiny_model_dir, tmp_path / "plugin", loss_type="scaled_pg")
    assert our_seen == dapo_seen and len(our_log) == len(dapo_log) == 3
    for step, (theirs, mine) in enumerate(zip(dapo_log, our_log), start=1):
        for key in ("loss", "grad_norm", "entropy"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), (step, key)
        assert mine["plugin/ratio_mean"] == 1.0
    assert plugin.read_text().splitlines() == ["True"] * 3  # one micro-batch per step, entropy given
    for (name, theirs), mine in zip(dapo.model.named_parameters(), ours.model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_a_plugin_loss_is_refused_where_trl_would_compute_the_loss(plugin, tiny_model_dir, tmp_path):
    settings = loss_settings("scaled_pg", "token", 0.2, 0.28, None, 0.04, True, 8)
    assert settings.aggregation == "token_mean"  # the plugin's registered normaliser
    assert settings.options["clip_high"] == 0.28 and settings.options["kl_coef"] == 0.04  # fit's names, TRL's values
    with pytest.raises(ValueError, match=r"GRPOConfig.loss_type='scaled_pgg': arctic-rl's losses are \[.*'scaled_pg'"):
        loss_settings("scaled_pgg", "token", 0.2, 0.2, None, 0.0, True, 8)
    with pytest.raises(ValueError, match=r"loss_type='scaled_pg' is a plugin loss.*unset top_entropy_quantile=0.5"):
        run_grpo(ArcticGRPOTrainer, tiny_model_dir, tmp_path / "refused", loss_type="scaled_pg", top_entropy_quantile=0.5)


@pytest.mark.slow
def test_the_readme_example_runs(tmp_path):
    """docs/trl.md: its complete example runs as written (paths moved under tmp_path)."""
    code = re.search(r"<!-- trl-example -->\n```python\n(.*?)```", (REPO / "docs" / "trl.md").read_text(), re.S).group(1)
    code = code.replace('"runs/trl', '"' + str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = re.search(r"reward ([\d.]+) dedup ([\d.]+)x \((\d+) of (\d+) tokens\)", done.stdout)
    assert summary and float(summary.group(2)) > 1.0 and int(summary.group(3)) < int(summary.group(4)), done.stdout[-2000:]
