"""The rollout stream (``rollout/stream/``): rounds of at most a token budget on a real transformers engine whose
weights change between rounds as a trainer's would. Each token's version and sampler log-prob are checked against the
model's own forward at that version; the staleness bound holds under both stale-group policies; a stream saved through
a checkpoint and resumed trains every group exactly once, as the uninterrupted stream does; a round that fails or
hangs ends the step with an error."""

from __future__ import annotations

import io
import time

import pytest
import torch

from arctic_rl.data.prompts import PROMPT, PROMPT_IDS, load_rows
from arctic_rl.rollout.stream.stream import RolloutStream, StreamError

BATCH = 4  # prompts per step


@pytest.fixture(scope="module")
def stream_setup(tiny_model_dir, toy_task):
    """The toy task's module (tokenizer and reward), a real transformers engine, the model's own copy for reference
    forwards, and 12 loader batches of 4 prompts."""
    from transformers import AutoModelForCausalLM

    from arctic_rl.modules.options import SamplingOptions
    from arctic_rl.rollout.engines.factory import make_engine
    from arctic_rl.tasks.toy import EchoDigitGRPO

    module = EchoDigitGRPO(model=str(tiny_model_dir), sampling=SamplingOptions(
        group_size=2, max_prompt_length=32, max_response_length=7, temperature=1.0, seed=5))
    engine = make_engine("transformers", str(tiny_model_dir), dtype="float32", max_model_len=64, seed=0, device="cpu", engine_kwargs={})
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rows = load_rows(toy_task / "train.jsonl")[: 12 * BATCH]
    batches = []
    for s in range(12):
        part = rows[s * BATCH : (s + 1) * BATCH]
        ids = [module.tokenizer(r["prompt"])["input_ids"] for r in part]
        batches.append({PROMPT: [r["prompt"] for r in part], PROMPT_IDS: ids, "answer": [r["answer"] for r in part]})
    base = {k: v.clone() for k, v in reference.state_dict().items()}
    yield module, engine, reference, base, batches
    engine.shutdown()


_WEIGHTS: dict[int, dict[str, torch.Tensor]] = {}


def weights(base: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """The trainer's weights after ``version`` steps: a fixed perturbation per version, large enough that two
    versions give visibly different log-probs."""
    if version not in _WEIGHTS:
        generator = torch.Generator().manual_seed(1000 + version)
        _WEIGHTS[version] = {k: v + 0.3 * torch.randn(v.shape, generator=generator) if version and v.is_floating_point() else v.clone()
                             for k, v in base.items()}
    return _WEIGHTS[version]


def run(stream: RolloutStream, engine, base, batches, steps: range, record: list, ahead: int = 1, take: int = BATCH) -> None:
    """The callback's loop (``RolloutCallback`` with a stream): take the step's groups, admit the next ``ahead``
    batches and start a round, "train" (the weights of the next version), finish the round, push the weights."""
    for t in steps:
        stream.admit(batches[t], t)
        rollout, metrics, uids = stream.take(take, t)
        record.append((t, uids, rollout, metrics))
        stream.launch([(batches[s], s) for s in range(t + 1, min(t + 1 + ahead, len(batches)))], t + 1)
        stream.finish()
        engine.update_weights(weights(base, t + 1).items())
        stream.synced(t + 1)


def make_stream(module, engine, version: int, **kwargs) -> RolloutStream:
    options = {"max_staleness": 3, "budget": 2, "steps_per_batch": 1, "weights_step": version, **kwargs}
    return RolloutStream(engine, module, **options)


def reference_logprobs(reference, base, version: int, prompt: list[int], tokens: list[int]) -> list[float]:
    if getattr(reference, "arctic_version", None) != version:
        reference.load_state_dict(weights(base, version))
        reference.arctic_version = version
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(input_ids=ids).logits[0].float(), dim=-1)
    return [logprobs[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(tokens)]


def test_each_token_carries_the_version_and_log_prob_of_the_weights_that_sampled_it(stream_setup):
    module, engine, reference, base, batches = stream_setup
    engine.update_weights(weights(base, 0).items())
    stream, record = make_stream(module, engine, 0), []
    run(stream, engine, base, batches, range(6), record, ahead=2)
    stream.close()
    mixed = 0
    for t, _, rollout, metrics in record:
        assert metrics["rollout/staleness"] <= 3
        for i in range(rollout.num_sequences):
            n = int(rollout.response_mask[i].sum())
            tokens, versions = rollout.response_ids[i, :n].tolist(), rollout.token_versions[i, :n].tolist()
            assert versions == sorted(versions) and all(t - 3 <= v <= t for v in versions)
            mixed += len(set(versions)) > 1
            expected = [0.0] * n  # each token under the weights of its own version, its prefix as sampled
            for v in set(versions):
                scores = reference_logprobs(reference, base, v, rollout.prompt_token_ids[i], tokens)
                expected = [scores[j] if versions[j] == v else e for j, e in enumerate(expected)]
            assert rollout.sampler_logprobs[i, :n].tolist() == pytest.approx(expected, abs=2e-4)
            if len(set(versions)) > 1:  # the check can fail: the newest weights do not give the older tokens' log-probs
                newest = reference_logprobs(reference, base, max(versions), rollout.prompt_token_ids[i], tokens)
                assert max(abs(a - b) for a, b, v in zip(newest, expected, versions) if v != max(versions)) > 1e-2
    assert mixed >= 4  # samples paused and continued across a weight update were trained
    assert sum(m["stream/partial_token_frac"] for *_, m in record) > 0


@pytest.mark.parametrize("policy", ["regenerate", "drop"])
def test_the_stream_never_trains_a_token_past_its_bound(stream_setup, policy):
    """Two batches in flight, a one-token budget against seven-token samples, and steps that take 3 of the 4 groups
    each batch brings: groups age in the stream until they outlive the bound of 2."""
    module, engine, _, base, batches = stream_setup
    engine.update_weights(weights(base, 0).items())
    drawn = []

    def refill(count, step, draw):
        drawn.append((step, draw))
        return {k: v[:count] for k, v in batches[-1 - draw % 3].items()}

    stream, record = make_stream(module, engine, 0, max_staleness=2, budget=1, stale_groups=policy, refill=refill), []
    run(stream, engine, base, batches, range(10), record, ahead=1, take=3)
    stream.close()
    for t, uids, rollout, metrics in record:
        trained = rollout.token_versions[rollout.response_mask > 0]
        assert int((t - trained).max()) <= 2 and metrics["rollout/staleness"] <= 2
        assert len(uids) == 3 and len(set(uids)) == 3
    counted = sum(m[f"stream/{'regenerated' if policy == 'regenerate' else 'dropped'}_groups"] for *_, m in record)
    assert counted > 0
    if policy == "drop":
        assert len(drawn) >= counted  # every dropped group was replaced by a fresh prompt
        assert any("r" in u.split("/")[0] for _, uids, *_ in record for u in uids)


@pytest.mark.parametrize("max_num_gen_batches", [1, 2, 50])
def test_dynamic_sampling_under_the_stream_trains_informative_groups_and_says_which_it_used(stream_setup, tiny_model_dir, max_num_gen_batches):
    """``model.rollout.dynamic_sampling`` with the stream: on a random model most echo groups score all zeros. Each step
    trains only groups whose rewards differ, each equal-reward group replaced by one fresh prompt while the step's
    allowance ((max_num_gen_batches - 1) x 4) lasts, then padded with dropped groups; the counts are exact."""
    from arctic_rl.modules.options import RolloutOptions, SamplingOptions
    from arctic_rl.rollout.dynamic_sampling import informative
    from arctic_rl.tasks.toy import EchoDigitGRPO

    _, engine, _, base, batches = stream_setup
    module = EchoDigitGRPO(model=str(tiny_model_dir), rollout=RolloutOptions(dynamic_sampling={"max_num_gen_batches": max_num_gen_batches}),
                           sampling=SamplingOptions(group_size=2, max_prompt_length=32, max_response_length=7, temperature=1.0, seed=5))
    engine.update_weights(weights(base, 0).items())
    drawn = []

    def refill(count, step, draw):
        drawn.append((step, draw))
        return {k: v[:count] for k, v in batches[(step + draw) % len(batches)].items()}

    stream, record = make_stream(module, engine, 0, refill=refill), []
    run(stream, engine, base, batches, range(5), record)
    stream.close()
    for t, uids, rollout, metrics in record:
        keep = informative(rollout.rewards, 2)
        dropped, padded = metrics["dynamic_sampling/dropped_groups"], metrics["dynamic_sampling/padded_groups"]
        assert len(uids) == len(set(uids)) == BATCH and keep.count(False) == padded  # only the padding is uninformative
        assert keep == [True] * (BATCH - int(padded)) + [False] * int(padded)
        assert metrics["dynamic_sampling/informative_frac"] == pytest.approx((BATCH - padded) / (BATCH - padded + dropped))
        if max_num_gen_batches == 1:
            assert padded == min(dropped, BATCH - keep.count(True)) and not drawn
    refills = [u for _, uids, *_ in record for u in uids if "r" in u.split("/")[0]]
    total_dropped = sum(m["dynamic_sampling/dropped_groups"] for *_, m in record)
    assert total_dropped > 0
    if max_num_gen_batches == 50:  # plenty of fresh prompts: no padding, refills trained
        assert all(m["dynamic_sampling/padded_groups"] == 0 for *_, m in record) and refills
        assert len(drawn) == total_dropped  # one fresh prompt per dropped group
    if max_num_gen_batches == 2:
        assert all(len([d for d in drawn if d[0] == t]) <= BATCH for t in range(5))  # the step's allowance


def test_a_resumed_stream_trains_every_saved_group_once_as_the_uninterrupted_one_does(stream_setup):
    module, engine, _, base, batches = stream_setup
    engine.update_weights(weights(base, 0).items())
    full, full_record = make_stream(module, engine, 0), []
    run(full, engine, base, batches, range(8), full_record, ahead=2)
    left = {g.uid for g in full.groups}
    full.close()

    engine.update_weights(weights(base, 0).items())
    first, record = make_stream(module, engine, 0), []
    run(first, engine, base, batches, range(4), record, ahead=2)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)  # the checkpoint after step 3 (weights of version 4 pushed)
    assert any(not g.complete and g.samples and g.samples[0].token_ids for g in first.groups)  # paused samples in it
    first.close()
    resumed = make_stream(module, engine, 4)  # a new process: the engine starts from the checkpoint's weights
    resumed.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))
    run(resumed, engine, base, batches, range(4, 8), record, ahead=2)
    resumed.close()

    trained = [u for _, uids, *_ in record for u in uids]
    assert len(trained) == len(set(trained)) == 8 * BATCH  # nothing trained twice
    assert [uids for _, uids, *_ in record] == [uids for _, uids, *_ in full_record]
    admitted = {f"{s}/{i}" for s in range(10) for i in range(BATCH)}
    assert set(trained) | left == admitted and not set(trained) & left  # nothing lost: trained, or still in the stream
    for (_, _, a, ma), (_, _, b, mb) in zip(record, full_record):
        assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.token_versions, b.token_versions)
        assert torch.equal(a.sampler_logprobs, b.sampler_logprobs) and torch.equal(a.rewards, b.rewards)
        assert ma["stream/partial_token_frac"] == mb["stream/partial_token_frac"]


def test_with_the_engine_kept_busy_rounds_run_until_the_step_ends_within_the_bound(stream_setup):
    """``rounds_per_step=None``: rounds go on while the "training step" lasts (here 0.3 s), ending at its end or
    when nothing is left unfinished; which weights sample which segment depends on timing, the bound does not."""
    module, engine, _, base, batches = stream_setup
    engine.update_weights(weights(base, 0).items())
    stream, trained, rounds = make_stream(module, engine, 0, max_staleness=2, budget=1, rounds_per_step=None), [], []
    for t in range(6):
        stream.admit(batches[t], t)
        rollout, metrics, uids = stream.take(BATCH, t)
        trained += uids
        assert int((t - rollout.token_versions[rollout.response_mask > 0]).max()) <= 2
        stream.launch([(batches[t + 1], t + 1)], t + 1)
        time.sleep(0.3)
        stream.finish()
        rounds.append(stream.last_rounds)
        engine.update_weights(weights(base, t + 1).items())
        stream.synced(t + 1)
    stream.close()
    assert len(trained) == len(set(trained)) == 6 * BATCH
    assert max(rounds) >= 5  # one-token rounds went on through the step (seven-token samples need seven)


class FaultInjectingEngine:
    """Fake (a fault injector around the real engine): ``generate`` raises, or blocks until released."""

    def __init__(self, engine, mode: str) -> None:
        self.engine, self.mode, self.release = engine, mode, False

    def generate(self, prompts, sampling):
        if self.mode == "raise":
            raise ConnectionError("engine process exited")
        while not self.release:
            time.sleep(0.05)
        return self.engine.generate(prompts, sampling)


@pytest.mark.parametrize("mode,match", [("raise", "round failed: ConnectionError: engine process exited"),
                                        ("hang", "ran past round_timeout_s=1 s")])
def test_a_round_that_fails_or_hangs_ends_the_step_with_an_error(stream_setup, mode, match):
    module, engine, _, base, batches = stream_setup
    faulty = FaultInjectingEngine(engine, mode)
    stream = make_stream(module, faulty, 0, round_timeout_s=1.0)
    stream.admit(batches[0], 0)
    stream.launch([(batches[1], 1)], 1)
    with pytest.raises(StreamError, match=match):
        stream.finish()
    faulty.release = True
    stream.close()


@pytest.mark.parametrize("kwargs,match", [
    ({"max_staleness": 1, "partial_rollout_tokens": 4}, "partial_rollout_tokens needs max_staleness >= 2"),
    ({"max_staleness": 2, "partial_rollout_tokens": 0}, "partial_rollout_tokens must be an integer >= 1"),
    ({"max_staleness": 2, "partial_rollout_tokens": 4, "stale_groups": "keep"}, "stale_groups must be 'regenerate' or 'drop'"),
])
def test_stream_options_are_checked_when_the_callback_is_built(kwargs, match):
    from arctic_rl.errors import ConfigError
    from arctic_rl.rollout.callback import RolloutCallback

    with pytest.raises(ConfigError, match=match):
        RolloutCallback(engine="transformers", **kwargs)


class RecordTrained:
    """Records, per optimizer step, the prompts and completions trained on (the stream's, not the loader batch's)."""

    def __init__(self) -> None:
        import lightning.pytorch as pl

        class Recorder(pl.Callback):
            def on_train_batch_end(inner, trainer, pl_module, outputs, batch, batch_idx):  # noqa: N805
                rollout = batch["rollout"]
                self.steps[trainer.global_step - 1] = {"trained": list(zip(rollout.prompts, rollout.completions)),
                                                       "loss": float(trainer.callback_metrics["loss"])}

        self.steps: dict[int, dict] = {}
        self.callback = Recorder()


def fit_with_stream(toy_task, root, ckpt_path: str | None = None) -> tuple[RecordTrained, list[dict]]:
    from arctic_rl.cli import build_cli
    from tests.helpers import quickstart_config, write_config
    from tests.rollout.test_overlap import logged_rows

    changes = {"trainer.max_steps": 6, "data.init_args.batch_size": 4, "model.init_args.sampling.group_size": 4,
               "model.init_args.optim.warmup_steps": 0, "model.init_args.sampling.seed": 11}
    config = quickstart_config(toy_task, root, **changes)
    config["trainer"]["callbacks"][0]["init_args"].update(engine="transformers", max_staleness=3, partial_rollout_tokens=3,
                                                          over_provisioning=2, rounds_per_step=1)  # reproducible
    config["trainer"]["callbacks"][1]["init_args"]["every_n_train_steps"] = 3
    cli = build_cli(["--config", str(write_config(config, root.with_suffix(".yaml")))], run=False)
    recorder = RecordTrained()
    cli.trainer.callbacks.append(recorder.callback)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return recorder, logged_rows(root)


@pytest.mark.slow
def test_fit_with_the_stream_logs_its_staleness_and_a_resume_trains_the_saved_groups_once(toy_task, tmp_path):
    """``fit`` with the stream on the transformers engine (8-token samples, 3-token rounds, two batches in flight);
    the checkpoint after step 2 holds paused samples, and the resumed run trains what the uninterrupted one does."""
    full, rows = fit_with_stream(toy_task, tmp_path / "full")
    assert len(rows) == 6 and all(r["rollout/staleness"] <= 3 for r in rows)
    assert max(r["rollout/staleness"] for r in rows) >= 2 and max(r["stream/partial_token_frac"] for r in rows) > 0.5
    assert all(r["stream/in_flight_groups"] + r["stream/buffered_groups"] == 4 for r in rows[1:5])  # the next batch, started
    trained = [pair for s in range(6) for pair in full.steps[s]["trained"]]
    ckpt = tmp_path / "full" / "checkpoints" / "epoch=0-step=3.ckpt"
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    (state,) = [v["stream"] for k, v in saved.items() if k.startswith("RolloutCallback")]
    assert any(s["token_ids"] and s["finish_reason"] is None for g in state["groups"] for s in g["samples"])  # paused ones

    resumed, resumed_rows = fit_with_stream(toy_task, tmp_path / "resumed", ckpt_path=str(ckpt))
    assert sorted(resumed.steps) == [3, 4, 5]
    for s in (3, 4, 5):
        assert resumed.steps[s]["trained"] == full.steps[s]["trained"]
        assert resumed.steps[s]["loss"] == pytest.approx(full.steps[s]["loss"], abs=1e-5)
    assert [r["stream/partial_token_frac"] for r in resumed_rows] == [r["stream/partial_token_frac"] for r in rows[3:]]
    assert len(trained) == 6 * 4 * 4


@pytest.mark.slow
def test_sigterm_mid_stream_then_resume_trains_every_group_exactly_once(toy_task, tmp_path):
    """A real SIGTERM as step 3 starts, with two batches in flight and paused samples: the checkpoint holds them, and the
    resumed run trains each admitted group once, the same groups at the same steps as an uninterrupted run."""
    from arctic_rl.cli import main
    from tests.helpers import quickstart_config, run_cli, write_config
    from tests.resume.recorder import read_steps

    def config(root, *callbacks):
        c = quickstart_config(toy_task, root, **{"trainer.max_steps": 6, "data.init_args.batch_size": 4, "trainer.enable_progress_bar": False,
                                                 "model.init_args.sampling.group_size": 4, "model.init_args.optim.warmup_steps": 0})
        c["trainer"]["callbacks"][0]["init_args"].update(engine="transformers", max_staleness=3, partial_rollout_tokens=3,
                                                         over_provisioning=2, rounds_per_step=1)
        c["trainer"]["callbacks"][1]["init_args"]["every_n_train_steps"] = 100
        record = {"class_path": "tests.resume.recorder.RecordStreamGroups", "init_args": {"path": str(root / "groups.jsonl")}}
        c["trainer"]["callbacks"] += [record, *callbacks]
        return c

    main(["fit", "--config", str(write_config(config(tmp_path / "full"), tmp_path / "full.yaml"))])
    sigterm = {"class_path": "tests.resume.recorder.SigtermAtStep", "init_args": {"step": 3}}
    done = run_cli(config(tmp_path / "cut", sigterm), tmp_path / "cut.yaml")
    assert done.returncode == 143, done.stderr[-3000:]
    last = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    (state,) = [v["stream"] for k, v in torch.load(last, weights_only=True)["callbacks"].items() if k.startswith("RolloutCallback")]
    assert len(state["groups"]) == 8  # batches 4 and 5, started during step 3
    assert any(s["token_ids"] and s["finish_reason"] is None for g in state["groups"] for s in g["samples"])  # paused ones
    main(["fit", "--config", str(write_config(config(tmp_path / "cut"), tmp_path / "resumed.yaml")), "--ckpt_path", str(last)])

    full, cut = read_steps(tmp_path / "full" / "groups.jsonl"), read_steps(tmp_path / "cut" / "groups.jsonl")
    assert sorted(cut) == list(range(6))  # steps 0-3 before the signal (step 3 finished), 4-5 after the resume
    trained = [g for s in range(6) for g in cut[s]["groups"]]
    assert len(trained) == len(set(trained)) == 6 * 4  # nothing trained twice, nothing skipped
    assert all(cut[s]["groups"] == full[s]["groups"] for s in range(6))
