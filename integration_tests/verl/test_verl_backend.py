"""verl 0.9.1 drives arctic-rl: two GRPO steps of verl's own trainer code against a real arctic-rl core.

What ran, precisely (all real verl 0.9.1 code unless named):
- the config: verl's ``ppo_trainer.yaml`` composed by Hydra with the overrides a user adds (docs/verl.md, "Use from
  verl"): ``actor._target_``/``strategy`` select ``ArcticRLActorConfig``, whose engine section is the client.
- the actor: verl's ``ActorRolloutRefWorker(role="actor").init_model()`` builds its ``TrainingWorker``, which
  builds ``ArcticRLEngine`` through ``EngineRegistry.new`` (strategy ``arctic_rl``); the worker's
  ``compute_log_prob`` and ``update_actor`` (``train_mini_batch``: mini-batch iterator, ``train_batch``,
  metrics) run unchanged. Ray is not started: the worker is called in-process, and the test stands in for
  Ray's process-group setup (a one-rank gloo group, conftest).
- the trainer: ``RayPPOTrainer._compute_old_log_prob`` and ``_update_actor`` (padding <-> no-padding, meta
  info, metric renaming) called with a stand-in ``self`` holding the composed config and the worker (the
  worker group's place); ``compute_response_mask`` and ``compute_advantage`` (GRPO, ``uid`` groups) as
  ``fit`` calls them. ``RayPPOTrainer.fit`` itself (Ray, the agent loop, the dataloader and reward manager)
  runs in ``test_verl_main_ppo.py``; here the toy reward is computed in the test.
- rollouts: ``ArcticRLRollout.generate_sequences`` (ours, verl's ``BaseRollout`` interface) on the same
  client; the arctic-rl core samples with its transformers engine (vLLM needs a newer transformers).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from arctic_rl.integrations import verl_replica
from arctic_rl.integrations.verl import ArcticRLRollout
from arctic_rl.integrations.verl_mapping import UnsupportedVerlSetting, loss_settings
from arctic_rl.tasks.toy import echo_score, make_rows

G, PROMPTS, STEPS = 4, 4, 2


# the overrides docs/verl.md tells a user to add (checked to be there, verbatim)
SELECT_ARCTIC_RL = [
    "actor_rollout_ref.model.external_lib=arctic_rl.integrations.verl",
    "actor_rollout_ref.actor._target_=arctic_rl.integrations.verl.ArcticRLActorConfig",
    "actor_rollout_ref.actor.strategy=arctic_rl",
    "+actor_rollout_ref.actor.arctic_rl.client=arctic_client.yaml",
    "actor_rollout_ref.rollout.name=arctic_rl",
]


def write_client_config(root: Path) -> Path:
    """docs/verl.md's ``arctic_client.yaml`` for the toy task on CPU (32 + 8 tokens), written under ``root``."""
    import yaml

    client = {"training": {"accelerator": "cpu"}, "server": {"root_dir": str(root / "arctic")},
              "engines": {"engine": "transformers"}, "sampling": {"max_prompt_length": 32, "max_response_length": 8}}
    (root / "arctic_client.yaml").write_text(yaml.safe_dump(client))
    return root / "arctic_client.yaml"


def arctic_overrides(model_dir, root, lr: float = 0.003) -> list[str]:
    """docs/verl.md's overrides with ``arctic_client.yaml`` written under ``root``, plus the tiny model and
    the batch shape (``PROMPTS`` prompts x ``G`` samples, 32 + 8 tokens): shared by both verl tests."""
    write_client_config(root)
    return [line.replace("=arctic_client.yaml", f"={root / 'arctic_client.yaml'}") for line in SELECT_ARCTIC_RL] + [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        f"actor_rollout_ref.rollout.n={G}",
        "actor_rollout_ref.rollout.response_length=8",
        "actor_rollout_ref.rollout.prompt_length=32",
        "algorithm.adv_estimator=grpo",
    ]


def verl_config(model_dir, root, extra: tuple[str, ...] = ()):
    """verl's default PPO config with a user's overrides selecting the arctic_rl strategy (then ``extra``); the
    client config is ``arctic_client.yaml`` as in docs/verl.md (written under ``root``, the test's working directory)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from verl.trainer import config as verl_configs

    overrides = arctic_overrides(model_dir, root) + list(extra)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(verl_configs.__path__[0]), version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def prompt_batch(tokenizer, rows, step: int):
    """The prompts as verl's dataloader hands them to the rollout: left-padded ids, ``uid`` per prompt."""
    from verl import DataProto

    ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, width - len(x):], mask[i, width - len(x):] = torch.tensor(x), 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    non_tensors = {"uid": np.array([f"{step}-{i}" for i in range(len(rows))], dtype=object),
                   "answer": np.array([r["answer"] for r in rows], dtype=object)}
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids},
                               non_tensors=non_tensors, meta_info={"seed": step})


def reference_logprobs(model, batch) -> torch.Tensor:
    """``[B, R]`` log-probs of the responses under ``model(ids).logits`` (log-softmax), masked."""
    out = torch.zeros(batch.batch["responses"].shape)
    width = batch.batch["prompts"].shape[1]
    for i in range(len(batch)):
        mask = batch.batch["attention_mask"][i].bool()
        ids = batch.batch["input_ids"][i][mask]
        p, r = int(mask[:width].sum()), int(mask[width:].sum())
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        out[i, :r] = logp[p - 1: p + r - 1].gather(-1, ids[p:, None])[:, 0]
    return out


def verl_jagged(per_token, batch) -> torch.Tensor:
    """``[B, R]`` response values in verl's no-padding model-output layout (position t: token t + 1), built
    here independently of the adapter's ``to_verl_jagged``."""
    width, rows = batch.batch["prompts"].shape[1], []
    for mask, values in zip(batch.batch["attention_mask"], per_token):
        p, r = int(mask[:width].sum()), int(mask[width:].sum())
        rows.append(torch.cat([torch.zeros(p - 1), values[:r], torch.zeros(1)]))
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def rollout_with_advantages(rollout: ArcticRLRollout, step: int):
    """verl's batch after the rollout, the toy reward and GRPO advantages, as ``fit`` builds it before the
    log-prob passes (``PROMPTS`` prompts x ``G`` samples, prompts seeded by ``step``)."""
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import compute_advantage, compute_response_mask

    tokenizer = rollout.model_config.tokenizer
    batch = rollout.generate_sequences(prompt_batch(tokenizer, make_rows(PROMPTS, seed=step), step))
    batch.batch["response_mask"] = compute_response_mask(batch)
    texts = tokenizer.batch_decode(batch.batch["responses"] * batch.batch["response_mask"], skip_special_tokens=True)
    scores = torch.zeros(batch.batch["responses"].shape)
    last = batch.batch["response_mask"].sum(1) - 1
    rewards = [echo_score(text, answer) for text, answer in zip(texts, batch.non_tensor_batch["answer"])]
    scores[torch.arange(len(texts)), last] = torch.tensor(rewards)  # verl's outcome reward: on the last token
    batch.batch["token_level_scores"] = batch.batch["token_level_rewards"] = scores
    batch = compute_advantage(batch, AdvantageEstimator.GRPO, num_repeat=G)
    batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()  # as fit() sets it
    return batch


@pytest.fixture(scope="module")
def two_steps(tiny_model_dir, one_rank_group, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import ActorRolloutRefWorker

    config = verl_config(tiny_model_dir, tmp_path_factory.mktemp("arctic-root"))
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    client = worker.actor.engine.client
    rollout = ArcticRLRollout(omega_conf_to_dataclass(config.actor_rollout_ref.rollout),
                              omega_conf_to_dataclass(config.actor_rollout_ref.model), client=client)
    trainer = SimpleNamespace(config=config, actor_rollout_wg=worker, distillation_config=None)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    steps = []
    for step in range(STEPS):
        batch = rollout_with_advantages(rollout, step)
        old, _ = RayPPOTrainer._compute_old_log_prob(trainer, batch)
        batch = batch.union(old)
        reference = reference_logprobs(initial, batch) if step == 0 else None
        metrics = RayPPOTrainer._update_actor(trainer, batch).meta_info["metrics"]
        asyncio.run(rollout.update_weights())  # what verl's update_weights awaits after each step
        steps.append(SimpleNamespace(batch=batch, metrics=metrics, reference=reference))
    weights, peft_config = worker.actor.engine.get_per_tensor_param()  # what verl streams to its own rollouts
    trained = dict(weights)
    yield SimpleNamespace(steps=steps, initial=initial, trained=trained, worker=worker, config=config,
                          model_dir=tiny_model_dir)
    client.close()
    verl_replica.unregister_worker_client(client)


def test_old_log_probs_equal_the_models_own_forward(two_steps):
    """verl's ``old_log_probs`` (arctic-rl's ZoRRo forward, back through verl's no-padding layout) and the
    rollout's ``rollout_log_probs`` equal ``log_softmax(model(ids).logits)`` of the initial weights."""
    first = two_steps.steps[0]
    mask = first.batch.batch["response_mask"].bool()
    assert mask.sum() > 0
    torch.testing.assert_close(first.batch.batch["old_log_probs"][mask], first.reference[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(first.batch.batch["rollout_log_probs"][mask], first.reference[mask], atol=1e-4, rtol=0)


def test_rollouts_sample_from_the_updated_policy(two_steps):
    """After step 1's ``update_weights``, step 2's sampler log-probs are the trained policy's (verl's
    ``old_log_probs`` from the actor), not the initial weights'."""
    second = two_steps.steps[1]
    mask = second.batch.batch["response_mask"].bool()
    torch.testing.assert_close(second.batch.batch["rollout_log_probs"][mask], second.batch.batch["old_log_probs"][mask],
                               atol=1e-4, rtol=0)
    stale = reference_logprobs(two_steps.initial, second.batch)
    assert (stale[mask] - second.batch.batch["old_log_probs"][mask]).abs().max() > 1e-3


def test_loss_equals_verls_own_ppo_loss(two_steps):
    """The loss arctic-rl computed in ``update_actor`` equals verl's ``ppo_loss`` (its vanilla policy loss,
    token-mean) evaluated on the same batch with the model's own log-probs."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    first = two_steps.steps[0]
    actor_config = two_steps.worker.loss_fn.keywords["config"]
    td = left_right_2_no_padding(first.batch.to_tensordict())
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(first.batch.batch["response_mask"].sum()),
                         global_batch_size=len(first.batch))
    expected, _ = ppo_loss(actor_config, {"log_probs": verl_jagged(first.reference, first.batch)}, td)
    (loss,) = first.metrics["actor/loss"] if isinstance(first.metrics["actor/loss"], list) else [first.metrics["actor/loss"]]
    assert loss == pytest.approx(float(expected), abs=1e-5)
    assert abs(loss) > 1e-4  # the toy rewards vary within groups: a non-trivial loss


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_off_policy_loss_equals_verls_ppo_loss_with_clipping(two_steps, agg_mode):
    """Step 2's batch against the weights after step 2 (ratios away from 1) with tight clip ratios and a dual
    clip that bind: arctic-rl's ``forward_backward`` under the mapped loss equals verl's ``ppo_loss`` on the
    trained model's own log-probs (gradients dropped after)."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    from arctic_rl.integrations.verl_mapping import train_batch_from_verl

    second = two_steps.steps[1]
    actor_config = replace(two_steps.worker.loss_fn.keywords["config"], loss_agg_mode=agg_mode,
                           clip_ratio_low=0.002, clip_ratio_high=0.002, clip_ratio_c=1.003)
    model = AutoModelForCausalLM.from_pretrained(two_steps.model_dir, dtype=torch.float32).eval()
    model.load_state_dict(two_steps.trained, strict=not model.config.tie_word_embeddings)
    current = reference_logprobs(model, second.batch)
    mask = second.batch.batch["response_mask"].bool()
    ratio = (current - second.batch.batch["old_log_probs"]).exp()[mask]
    assert ((ratio - 1).abs() > 0.002).float().mean() > 0.2  # the clip binds on many tokens

    td = left_right_2_no_padding(second.batch.to_tensordict())
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=len(second.batch))
    client = two_steps.worker.actor.engine.client
    got = client.forward_backward(train_batch_from_verl(td, with_loss_inputs=True), *loss_settings(actor_config))["loss"]
    client.zero_grad()
    expected, _ = ppo_loss(actor_config, {"log_probs": verl_jagged(current, second.batch)}, td)
    assert got == pytest.approx(float(expected), abs=1e-5)


def test_two_steps_change_the_weights(two_steps):
    """Both optimizer steps ran (finite, non-zero gradient norms) and every weight verl would stream to a
    rollout (``get_per_tensor_param``: Hugging Face names) differs from the initial model's."""
    for step in two_steps.steps:
        grad_norm = step.metrics["actor/grad_norm"]
        grad_norm = grad_norm[0] if isinstance(grad_norm, list) else grad_norm
        assert np.isfinite(grad_norm) and grad_norm > 0
        assert step.metrics["actor/lr"] == [pytest.approx(0.003)]  # one mini-batch; verl's optim.lr, arctic-rl's constant schedule
        assert "actor/clip_ratio/region_mean" in step.metrics  # arctic-rl's loss metrics, under verl's prefix
    initial, trained = two_steps.initial.state_dict(), two_steps.trained
    tied = {"lm_head.weight"} if two_steps.initial.config.tie_word_embeddings else set()
    assert set(trained) == set(initial) - tied
    unchanged = [name for name in trained if torch.equal(initial[name], trained[name])]
    assert unchanged == []


def test_readme_gives_these_overrides():
    readme = (Path(__file__).parents[2] / "docs" / "verl.md").read_text()
    block = readme.split("<!-- verl-example -->", 1)[1].split("```", 2)[1]
    assert [line.split()[0] for line in block.splitlines()[1:] if line.strip()] == SELECT_ARCTIC_RL


def test_unmappable_settings_are_refused_by_name(two_steps):
    from dataclasses import replace

    actor_config = two_steps.worker.loss_fn.keywords["config"]
    assert loss_settings(actor_config) == ("dapo", {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0})
    assert loss_settings(replace(actor_config, use_kl_loss=True, kl_loss_type="k3", kl_loss_coef=0.01, entropy_coeff=0.02)) \
        == ("dapo", {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0, "kl_coef": 0.01, "kl_bias_correction": False,
                     "kl_estimator": "low_var_kl", "entropy_coef": 0.02, "entropy_aggregation": "loss"})
    for change, key in (({"use_kl_loss": True, "kl_loss_type": "full"}, "kl_loss_type"),
                        ({"loss_agg_mode": "seq-mean-token-sum"}, "loss_agg_mode"),
                        ({"entropy_coeff": -0.01}, "entropy_coeff"), ({"clip_ratio_c": 1.1}, "clip_ratio_c")):
        with pytest.raises(UnsupportedVerlSetting, match=f"actor_rollout_ref.actor.{key}="):
            loss_settings(replace(actor_config, **change))


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The test plugin package ``arl_test_plugin_pg`` (``tests/plugin_package.py``) installed; yields its marker.
    The helper is loaded from its file: the verl layer ships a ``tests`` package of its own."""
    import importlib.util

    repo = Path(__file__).parents[2]
    spec = importlib.util.spec_from_file_location("arl_plugin_package", repo / "tests" / "plugin_package.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    yield from helper.installed_plugin(tmp_path, monkeypatch, repo)


def test_a_plugin_loss_mode_trains_through_the_engine(two_steps, plugin):
    """``policy_loss.loss_mode: scaled_pg`` (the installed plugin's loss; scale 1, its default): the engine's
    ``forward_backward_batch`` runs it on step 2's batch against the trained weights. With clip ratios that never
    bind, verl's vanilla token-mean loss is the same ``-sum(ratio * A) / tokens``, so the two agree. A loss_mode
    that is neither vanilla nor registered is refused when the actor config is built."""
    from dataclasses import replace
    from functools import partial

    from transformers import AutoModelForCausalLM
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    second = two_steps.steps[1]
    wide = replace(two_steps.worker.loss_fn.keywords["config"], clip_ratio_low=0.999, clip_ratio_high=1e3, clip_ratio_c=1e4)
    chosen = replace(wide, policy_loss=replace(wide.policy_loss, loss_mode="scaled_pg"))
    with pytest.raises(UnsupportedVerlSetting, match=r"policy_loss.loss_mode='scaled_pgg' .*\['scaled_pg'\]"):
        replace(wide, policy_loss=replace(wide.policy_loss, loss_mode="scaled_pgg"))
    model = AutoModelForCausalLM.from_pretrained(two_steps.model_dir, dtype=torch.float32).eval()
    model.load_state_dict(two_steps.trained, strict=not model.config.tie_word_embeddings)
    current = reference_logprobs(model, second.batch)
    mask = second.batch.batch["response_mask"].bool()

    def verl_batch():
        td = left_right_2_no_padding(second.batch.to_tensordict())
        tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=len(second.batch))
        return td

    engine = two_steps.worker.actor.engine
    out = engine.forward_backward_batch(verl_batch(), partial(ppo_loss, config=chosen))
    engine.client.zero_grad()
    expected, _ = ppo_loss(wide, {"log_probs": verl_jagged(current, second.batch)}, verl_batch())
    assert out["loss"][0] == pytest.approx(float(expected), abs=1e-5) and abs(out["loss"][0]) > 1e-4
    calls = plugin.read_text().splitlines()
    assert calls and set(calls) == {"True"}  # the plugin computed every micro-batch, with the entropy it needs
    assert "actor/plugin/ratio_mean" in out["metrics"]
