"""The rollout stream with multi-turn episodes (``rollout/stream/episodes.py``): the tool toy's episodes on a real
transformers engine whose weights change between rounds as a trainer's would. Each generated token's version and
sampler log-prob are checked against the trainer's own forward (ZoRRo's prefix tree) at that version; observations stay
out of the loss; the bound holds; a stream whose budget cuts no turn samples exactly what the synchronous loop samples,
faults included; a stream saved with paused episodes and resumed (environments replayed) trains every episode once, as
the uninterrupted one does, through ``fit`` too; in-flight weights and a budget in seconds cut turns as they cut
single-turn samples."""

from __future__ import annotations

import io

import pytest
import torch

from arctic_rl.data.prompts import PROMPT, PROMPT_IDS
from arctic_rl.modules.options import RolloutOptions, SamplingOptions
from arctic_rl.rollout.stream.stream import RolloutStream
from arctic_rl.tasks.tool_toy import PROMPT_TEXT, SecretDigitGRPO

BATCH, G, LENGTH = 3, 4, 16  # prompts per step, episodes per prompt, response budget (generated and observation tokens)
ENVIRONMENT = {"env_class": "arctic_rl.tasks.tool_toy.LookupEnvironment", "max_turns": 3}


@pytest.fixture(scope="module")
def setup(tool_model_dir, tool_tokenizer, hf_engine):
    """The tool toy's module (its model: the trainer's forward), the engine, the start weights and 10 loader batches."""
    module = SecretDigitGRPO(model=str(tool_model_dir), compute={"zorro_dedup": "tree"}, rollout=RolloutOptions(environment=ENVIRONMENT),
                             sampling=SamplingOptions(group_size=G, max_prompt_length=16, max_response_length=LENGTH, seed=7))
    module.configure_model()
    prompt = tool_tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    batches = [{PROMPT: [PROMPT_TEXT] * BATCH, PROMPT_IDS: [prompt] * BATCH, "answer": [str((s * BATCH + i) % 10) for i in range(BATCH)]}
               for s in range(12)]
    base = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    return module, hf_engine, base, batches


SAVED = 4  # the resumed run's first step

_WEIGHTS: dict[int, dict[str, torch.Tensor]] = {}


def weights(base: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights after ``version`` steps: a fixed perturbation per version."""
    if version not in _WEIGHTS:
        generator = torch.Generator().manual_seed(2000 + version)
        _WEIGHTS[version] = {k: v + 0.2 * torch.randn(v.shape, generator=generator) if version and v.is_floating_point() else v.clone()
                             for k, v in base.items()}
    return _WEIGHTS[version]


def make_stream(module, engine, version: int, **kwargs) -> RolloutStream:
    return RolloutStream(engine, module, **{"max_staleness": 3, "budget": 2, "steps_per_batch": 1, "weights_step": version, **kwargs})


def run(stream, engine, base, batches, steps: range, record: list, ahead: int = 2, take: int = BATCH) -> None:
    """The callback's loop: take the step's groups, admit the next ``ahead`` batches and run a round, push the next
    weights."""
    for t in steps:
        stream.admit(batches[t], t)
        rollout, metrics, uids = stream.take(take, t)
        record.append((t, uids, rollout, metrics))
        stream.launch([(batches[s], s) for s in range(t + 1, t + 1 + ahead)], t + 1)
        stream.finish()
        engine.update_weights(weights(base, t + 1).items())
        stream.synced(t + 1)


def trainer_logprobs(module, base, version: int, rollout) -> torch.Tensor:
    module.model.load_state_dict(weights(base, version))
    with torch.no_grad():
        return module.sequence_logprobs(module.model, rollout)[0]


def test_each_generated_token_carries_the_version_and_log_prob_that_sampled_it_across_turns(setup):
    module, engine, base, batches = setup
    engine.update_weights(weights(base, 0).items())
    stream, record = make_stream(module, engine, 0), []
    run(stream, engine, base, batches, range(8), record)
    stream.close()
    mixed_turns = observed_then_newer = 0
    for t, uids, rollout, metrics in record:
        assert len(set(uids)) == BATCH and metrics["rollout/staleness"] <= 3 and "multi_turn/turns_mean" in metrics
        generated, observed = rollout.response_mask > 0, rollout.observation_mask > 0
        assert not (generated & observed).any() and torch.equal(rollout.sampler_logprobs[observed], torch.zeros(int(observed.sum())))
        versions = rollout.token_versions
        assert all(t - 3 <= v <= t for v in versions[generated].tolist())
        expected = torch.zeros_like(rollout.sampler_logprobs)
        for v in versions[generated].unique().tolist():
            at_v = generated & (versions == v)
            expected[at_v] = trainer_logprobs(module, base, v, rollout)[at_v]
        assert torch.allclose(rollout.sampler_logprobs[generated], expected[generated], atol=1e-5, rtol=0)
        for i in range(rollout.num_sequences):
            n = int(rollout.sequence_mask[i].sum())
            row, gen = versions[i, :n].tolist(), generated[i, :n].tolist()
            assert row == sorted(row)  # observations take the version of the turn before them
            turns = [[]]  # the versions of each turn's generated tokens
            for j in range(n):
                if gen[j]:
                    turns[-1].append(row[j])
                elif turns[-1]:
                    turns.append([])
            mixed_turns += sum(len(set(turn)) > 1 for turn in turns)  # a turn paused at the budget, continued by newer weights
            observed_then_newer += any(not gen[j] and gen[j + 1] and row[j + 1] > row[j] for j in range(n - 1))
        if len(versions[generated].unique()) > 1:  # the check can fail: one version's weights do not give another's log-probs
            newest = trainer_logprobs(module, base, int(versions[generated].max()), rollout)
            older = generated & (versions < versions[generated].max())
            assert (newest[older] - expected[older]).abs().max() > 1e-2
    assert mixed_turns >= 3 and observed_then_newer >= 3
    assert sum(m["multi_turn/observation_tokens_mean"] for *_, m in record) > 0


@pytest.mark.parametrize("policy", ["regenerate", "drop"])
def test_the_stream_of_episodes_never_trains_a_token_past_its_bound(setup, policy):
    """A one-token budget against episodes of up to 16 tokens, steps that take 2 of the 3 groups a batch brings."""
    module, engine, base, batches = setup
    engine.update_weights(weights(base, 0).items())
    refill = lambda count, step, draw: {k: v[:count] for k, v in batches[-1 - draw % 3].items()}  # noqa: E731
    stream, record = make_stream(module, engine, 0, max_staleness=2, budget=1, stale_groups=policy, refill=refill), []
    run(stream, engine, base, batches, range(6), record, ahead=1, take=2)
    stream.close()
    for t, uids, rollout, metrics in record:
        assert int((t - rollout.token_versions[rollout.response_mask > 0]).max()) <= 2 and metrics["rollout/staleness"] <= 2
        assert len(uids) == len(set(uids)) == 2
    assert sum(m[f"stream/{'regenerated' if policy == 'regenerate' else 'dropped'}_groups"] for *_, m in record) > 0


def test_a_stream_whose_budget_cuts_no_turn_samples_what_the_synchronous_loop_samples(setup):
    from arctic_rl.rollout.generation import generate_rollout

    module, engine, base, batches = setup
    engine.update_weights(weights(base, 0).items())
    expected, expected_metrics = generate_rollout(engine, module, batches[4], step=4)
    stream = make_stream(module, engine, 4, budget=LENGTH)
    stream.admit(batches[4], 4)
    rollout, metrics, _ = stream.take(BATCH, 4)  # a round per turn
    stream.close()
    assert expected.observation_mask.sum() > 0  # the draw calls the tool
    for name in ("response_ids", "response_mask", "observation_mask", "sampler_logprobs", "rewards", "advantages", "truncated"):
        assert torch.equal(getattr(rollout, name), getattr(expected, name)), name
    assert rollout.completions == expected.completions
    assert {k: v for k, v in metrics.items() if k.startswith(("multi_turn/", "reward"))} == \
        {k: v for k, v in expected_metrics.items() if k.startswith(("multi_turn/", "reward"))}


def test_a_resumed_stream_of_paused_episodes_trains_each_once_as_the_uninterrupted_one_does(setup):
    """Steps take 2 of the 3 groups each batch brings: groups wait in the stream, some past the bound (regenerated)."""
    module, engine, base, batches = setup
    engine.update_weights(weights(base, 0).items())
    full, full_record = make_stream(module, engine, 0), []
    run(full, engine, base, batches, range(8), full_record, take=2)
    left = {g.uid for g in full.groups}
    full.close()

    engine.update_weights(weights(base, 0).items())
    first, record = make_stream(module, engine, 0), []
    run(first, engine, base, batches, range(SAVED), record, take=2)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)  # the checkpoint after step SAVED - 1 (weights of version SAVED pushed)
    paused = [s for g in first.groups for s in g.samples if not s.done and s.token_ids]
    assert any(s.tool_turns for s in paused) and any(s.turn_segments for s in paused)  # after an observation; mid-turn
    first.close()
    resumed = make_stream(module, engine, SAVED)  # a new process: environments are replayed, not saved
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    assert all(s.episode.env is not None for g in resumed.groups for s in g.samples if not s.done)
    run(resumed, engine, base, batches, range(SAVED, 8), record, take=2)
    resumed.close()

    trained = [u for _, uids, *_ in record for u in uids]
    assert len(trained) == len(set(trained)) == 8 * 2  # no group of episodes trained twice
    assert [uids for _, uids, *_ in record] == [uids for _, uids, *_ in full_record]
    admitted = {f"{s}/{i}" for s in range(10) for i in range(BATCH)}
    assert set(trained) | left == admitted and not set(trained) & left  # nothing lost: trained, or still in the stream
    for (_, _, a, ma), (_, _, b, mb) in zip(record, full_record):
        for name in ("response_ids", "observation_mask", "token_versions", "sampler_logprobs", "rewards"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert ma["stream/regenerated_groups"] == mb["stream/regenerated_groups"]
    assert sum(m["stream/regenerated_groups"] for *_, m in full_record) > 0


def test_an_episode_whose_replay_answers_otherwise_restarts_its_group_and_is_counted(setup, caplog):
    module, engine, base, batches = setup
    engine.update_weights(weights(base, 0).items())
    stream, record = make_stream(module, engine, 0), []
    run(stream, engine, base, batches, range(SAVED), record, take=2)
    state = stream.state_dict()
    stream.close()
    (group, sample) = next((g, s) for g in state["groups"] for s in g["samples"] if s["finish_reason"] is None and s["tool_turns"])
    _, end, _ = sample["tool_turns"][0]
    sample["episode"]["context"][sample["episode"]["prompt_length"] + end + 1] += 1  # the observation's digit, not the tool's
    resumed = make_stream(module, engine, SAVED)
    with caplog.at_level("WARNING"):
        resumed.load_state_dict(state)
    restarted = next(g for g in resumed.groups if g.uid == group["uid"])
    assert restarted.samples == [] and restarted.attempt == group["attempt"] + 1
    assert resumed.counts["regenerated_groups"] == 1 and "answered another observation" in caplog.text
    resumed.close()


def fit_multi_turn_stream(task, root, ckpt_path: str | None = None):
    from arctic_rl.cli import build_cli
    from tests.helpers import quickstart_config, write_config
    from tests.rollout.test_overlap import logged_rows
    from tests.rollout.test_stream import RecordTrained

    changes = {"trainer.max_steps": 6, "trainer.enable_checkpointing": True, "trainer.enable_progress_bar": False,
               "data.init_args.batch_size": 4, "model.init_args.sampling.group_size": 4, "model.init_args.sampling.seed": 3,
               "model.init_args.rollout.environment.max_turns": 3, "model.init_args.optim.warmup_steps": 0}
    config = quickstart_config(task, root, source="configs/multi_turn_toy.yaml", **changes)
    config["trainer"]["callbacks"][0]["init_args"].update(max_staleness=3, partial_rollout_tokens=3, over_provisioning=2, rounds_per_step=1)
    config["trainer"]["callbacks"].append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {
        "dirpath": str(root / "checkpoints"), "every_n_train_steps": 3, "save_top_k": -1}})
    cli = build_cli(["--config", str(write_config(config, root.with_suffix(".yaml")))], run=False)
    recorder = RecordTrained()
    cli.trainer.callbacks.append(recorder.callback)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return recorder, logged_rows(root)


@pytest.mark.slow
def test_fit_with_multi_turn_episodes_in_the_stream_and_a_resume_trains_the_saved_episodes_once(tmp_path):
    """``fit`` with ``model.rollout.environment`` and the stream (3-token rounds, two batches in flight) on the tool toy:
    the checkpoint after step 2 holds paused episodes, and the resumed run trains what the uninterrupted one does."""
    from arctic_rl.tasks.tool_toy import write_task

    task = write_task(tmp_path / "task", num_train=64)
    full, rows = fit_multi_turn_stream(task, tmp_path / "full")
    assert len(rows) == 6 and all(r["rollout/staleness"] <= 3 for r in rows) and max(r["rollout/staleness"] for r in rows) >= 2
    assert sum(r["multi_turn/observation_tokens_mean"] for r in rows) > 0 and max(r["stream/partial_token_frac"] for r in rows) > 0.5
    ckpt = tmp_path / "full" / "checkpoints" / "epoch=0-step=3.ckpt"
    (state,) = [v["stream"] for k, v in torch.load(ckpt, weights_only=True)["callbacks"].items() if k.startswith("RolloutCallback")]
    paused = [s for g in state["groups"] for s in g["samples"] if s["token_ids"] and s["finish_reason"] is None]
    assert paused and all(s["episode"] is not None for s in paused)

    resumed, resumed_rows = fit_multi_turn_stream(task, tmp_path / "resumed", ckpt_path=str(ckpt))
    assert sorted(resumed.steps) == [3, 4, 5]
    for s in (3, 4, 5):
        assert resumed.steps[s]["trained"] == full.steps[s]["trained"]
        assert resumed.steps[s]["loss"] == pytest.approx(full.steps[s]["loss"], abs=1e-5)
    assert [r["multi_turn/turns_mean"] for r in resumed_rows] == [r["multi_turn/turns_mean"] for r in rows[3:]]


def test_faults_end_their_episode_in_the_stream_as_in_the_synchronous_loop(tool_model_dir, tool_tokenizer, caplog):
    """The fault tests' scripted engine and tools (``test_multi_turn.py``): a tool that raises, hangs or answers too
    much ends its episode with its reason and ``fault_reward``, the others go on, the counts are logged, as in the
    synchronous loop."""
    from arctic_rl.rollout.generation import generate_rollout
    from tests.rollout.test_multi_turn import HERE, ScriptedEngine, rows_calling

    environment = {"env_class": f"{HERE}.FaultyTools", "max_turns": 3, "max_observation_tokens": 8, "step_timeout_s": 0.5, "fault_reward": -1.0}
    module = SecretDigitGRPO(model=str(tool_model_dir), rollout=RolloutOptions(environment=environment),
                             sampling=SamplingOptions(group_size=2, max_prompt_length=16, max_response_length=16, seed=0))
    module.configure_model()
    rows = rows_calling(tool_tokenizer, "lookup", "x", "y", "z", "say", "copy")
    batch = {PROMPT: [r["prompt"] for r in rows], PROMPT_IDS: [r["prompt_token_ids"] for r in rows], "answer": [r["answer"] for r in rows]}
    expected, expected_metrics = generate_rollout(ScriptedEngine(tool_tokenizer), module, batch, step=0)
    stream = make_stream(module, ScriptedEngine(tool_tokenizer), 0, budget=2)  # the answer "7 EOS" fits a segment
    stream.admit(batch, 0)
    with caplog.at_level("WARNING"):
        rollout, metrics, _ = stream.take(len(rows), 0)
    stream.close()
    assert metrics["multi_turn/fault_timeout"] == 2.0 and metrics["multi_turn/fault_frac"] == pytest.approx(8 / 12)
    for name in ("response_ids", "response_mask", "observation_mask", "rewards"):
        assert torch.equal(getattr(rollout, name), getattr(expected, name)), name
    same = lambda m: {k: v for k, v in m.items() if k.startswith("multi_turn/") and k != "multi_turn/abandoned_steps"}  # noqa: E731
    assert same(metrics) == same(expected_metrics)
    assert metrics["multi_turn/abandoned_steps"] >= 2  # the hung steps of this process, those of the synchronous run too
    assert "8 of 8 episodes ending in this stream round ended by a fault" in caplog.text  # the faults end at the first turn


def test_in_flight_weights_reach_an_episode_mid_turn_and_its_tokens_keep_the_engine_versions(setup):
    """``in_flight=True``: the step-1 weights are pushed while the first turn decodes (before its fourth token). That
    turn's tokens carry 0 then 1, their log-probs those of the older weights' keys and values under the newer weights
    (the KV cache is kept); the turns after the observation are all 1, scored as the trainer scores them."""
    from tests.rollout.test_in_flight import logprobs_across_switch, push_at_boundary

    switch = 3
    module, engine, base, batches = setup
    engine.update_weights(weights(base, 0).items())
    stream = make_stream(module, engine, 0, budget=LENGTH, in_flight=True)
    stream.admit(batches[0], 0)
    stream.before_sync(1)  # the weights pushed next are global step 1's
    errors = push_at_boundary(engine, weights(base, 1), switch + 1)
    try:
        rollout, _, _ = stream.take(BATCH, 0)
    finally:
        del engine.gate.checkpoint
    stream.close()
    assert not errors
    generated, versions = rollout.response_mask > 0, rollout.token_versions
    later = torch.zeros_like(generated)  # generated tokens after the first observation
    switched = 0
    for i in range(rollout.num_sequences):
        n = int(rollout.sequence_mask[i].sum())
        first = next((j for j in range(n) if not generated[i, j]), n)  # the first turn ends where its observation starts
        assert versions[i, :first].tolist() == [0 if j < switch else 1 for j in range(first)]
        assert versions[i, first:n][generated[i, first:n]].tolist() == [1] * int(generated[i, first:n].sum())
        assert all(versions[i, j] == versions[i, j - 1] for j in range(first, n) if not generated[i, j])  # the turn's before
        tokens = rollout.response_ids[i, :first].tolist()
        expected = logprobs_across_switch(module.model, weights(base, 0), weights(base, 1), rollout.prompt_token_ids[i], tokens, switch)
        assert rollout.sampler_logprobs[i, :first].tolist() == pytest.approx(expected, abs=1e-4)
        switched += first > switch
        later[i, first:n] = generated[i, first:n]
    assert switched >= 3 and later.sum() >= 3
    assert torch.allclose(rollout.sampler_logprobs[later], trainer_logprobs(module, base, 1, rollout)[later], atol=1e-5, rtol=0)


def test_a_budget_in_seconds_cuts_turns_as_a_one_token_budget_does(setup):
    """``partial_rollout_seconds`` already past when each round starts: every round gives each episode one token (the
    engine's least), so the episodes are those of a one-token budget, seed for seed."""
    module, engine, base, batches = setup
    engine.update_weights(weights(base, 0).items())
    rollouts = []
    for options in ({"budget": LENGTH, "budget_s": 1e-9}, {"budget": 1}):
        stream = make_stream(module, engine, 5, **options)
        stream.admit(batches[5], 5)
        rollouts.append(stream.take(BATCH, 5))
        stream.close()
    (cut, cut_metrics, _), (one, one_metrics, _) = rollouts
    assert cut.observation_mask.sum() > 0 and cut_metrics["stream/partial_sample_frac"] == 1.0
    for name in ("response_ids", "observation_mask", "sampler_logprobs", "rewards"):
        assert torch.equal(getattr(cut, name), getattr(one, name)), name
