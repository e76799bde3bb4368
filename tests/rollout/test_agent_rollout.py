"""Agent rollouts (``model.rollout.agent``, ``rollout/openai/agents.py``): the user's ``async def agent(client, row)``
written against the real ``openai`` SDK, run concurrently against the real endpoint on loopback that samples with the
real transformers engine (the agent toy's tiny Qwen3). The trained episode is what the endpoint rendered and sampled
(log-probs equal to the model's own forward), a turn that re-renders differently is split and counted, faults end one
episode with ``fault_reward``, bad requests are refused naming the field, ``max_in_flight`` bounds the episodes running,
and ``fit`` trains on them."""

from __future__ import annotations

import asyncio

import pytest
import torch

openai = pytest.importorskip("openai")

from arctic_rl.errors import ConfigError  # noqa: E402
from arctic_rl.options import AgentOptions, CorrectionConfig, ModuleOptions, OptimOptions, RolloutOptions  # noqa: E402
from arctic_rl.rollout.engines.base import SamplingConfig  # noqa: E402
from arctic_rl.rollout.openai.agent_server import close_agent_server  # noqa: E402
from arctic_rl.rollout.openai.agents import agent_metrics, run_agents  # noqa: E402
from arctic_rl.tasks.agent_toy import CALL, TOOLS, build_agent_tokenizer, make_rows  # noqa: E402
from tests.rollout.conftest import transformers_engine, write_tiny_model_for  # noqa: E402

HERE = "tests.rollout.test_agent_rollout"
SEEN: dict = {}  # what the test agents saw, by row id
RUNNING = {"now": 0, "most": 0}


@pytest.fixture(scope="module")
def tokenizer():
    return build_agent_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return write_tiny_model_for(tokenizer, tmp_path_factory.mktemp("agent_model"))


@pytest.fixture(scope="module")
def engine(model_dir):
    try:
        yield from transformers_engine(model_dir)
    finally:
        close_agent_server()


def prompt_ids(tokenizer, text: str = "code ?") -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def run(engine, tokenizer, rows, g, agent_fn="arctic_rl.tasks.agent_toy.lookup_agent", budget=20, seeds=None, **options):
    sampling = SamplingConfig(n=g, max_tokens=budget, prompt_seeds=seeds or tuple(range(100, 100 + len(rows))))
    return run_agents(engine, AgentOptions(agent_fn, **options), tokenizer, rows, [prompt_ids(tokenizer)] * len(rows), g,
                      sampling, 8)


# ---------------------------------------------------------------------------------------------------- what is trained
def test_each_episode_is_the_tokens_the_endpoint_rendered_and_sampled_with_the_models_log_probs(engine, tokenizer, model_dir):
    from transformers import AutoModelForCausalLM

    rows, g = make_rows(16, seed=3), 4
    ran = run(engine, tokenizer, rows, g)
    again = run(engine, tokenizer, rows, g)
    assert [c.token_ids for c in ran.completions] == [c.token_ids for c in again.completions]  # each turn's own seed
    assert ran.prompt_token_ids == [prompt_ids(tokenizer)] * len(rows)  # the chat template's, rendered once by the endpoint
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    called = 0
    for j, c in enumerate(ran.completions):
        prompt = ran.prompt_token_ids[j // g]
        assert len(c.token_ids) == len(c.loss_mask) == len(c.logprobs) and c.episode["agent"]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        sampled = torch.tensor(c.loss_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(c.logprobs)[sampled], expected[sampled], atol=1e-5, rtol=0)
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask) if m == 0)
        if c.episode["turns"] == 2 and c.episode["divergences"] == 0:  # it called the tool: the tool's message follows
            called += 1
            first = c.loss_mask.index(0)  # the first turn's sampled tokens, then the environment's
            environment = c.token_ids[first:c.loss_mask.index(1, first)]
            assert tokenizer.convert_tokens_to_ids(CALL) in c.token_ids[:first]
            tool_turn = f"<|im_start|> tool {rows[j // g]['code']} <|endoftext|> <|im_start|> assistant"
            assert tokenizer.decode(environment).endswith(tool_turn), tokenizer.decode(environment)
    assert called >= 1  # seeds 100-115 on the tiny model: some episodes call the tool


def test_a_turn_that_rerenders_its_history_differently_is_split_counted_and_trained_as_its_own_row(engine, tokenizer):
    from arctic_rl.rollout.batch import RolloutBatch
    from arctic_rl.rollout.openai.agents import with_split_rows

    rows = [{"prompt": "code ?", "code": "4", "id": 0, "mode": "edit"}]
    ran = run(engine, tokenizer, rows, g=2, agent_fn=f"{HERE}.mode_agent")
    edited = tokenizer.apply_chat_template([{"role": "user", "content": "code ?"}, {"role": "assistant", "content": "4"},
                                            {"role": "user", "content": "code ?"}], tools=TOOLS, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    for c in ran.completions:
        assert c.episode["divergences"] == 1 and c.episode["split_segments"] == 1 and c.episode["turns"] == 2
        assert sum(c.loss_mask) == len(c.token_ids)  # the first sequence: the first request's completion only
    assert [(e, p) for e, p, _ in ran.split_rows] == [(0, edited), (1, edited)]  # the second request, as rendered
    assert all(sum(c.loss_mask) == len(c.token_ids) >= 1 for _, _, c in ran.split_rows)
    assert agent_metrics(ran.completions) == {"agent/divergences": 2.0, "agent/split_segments": 2.0}
    # each split-off sequence trains as a row after the groups', with its episode's advantage and reward
    n, width = len(ran.completions), max(len(c.token_ids) for c in ran.completions)
    ids = torch.zeros((n, width), dtype=torch.long)
    for i, c in enumerate(ran.completions):
        ids[i, :len(c.token_ids)] = torch.tensor(c.token_ids)
    batch = RolloutBatch([ran.prompt_token_ids[0]] * n, ids, torch.ones(n, width), torch.zeros(n, width),
                         torch.tensor([1.0, 0.0]), torch.tensor([0.7, -0.7]), group_size=2, prompts=["p", "p"],
                         completions=["a", "b"], reward_components={"agent": torch.tensor([1.0, 0.0])})
    merged = with_split_rows(batch, ran.split_rows, tokenizer)
    assert merged.num_sequences == 4 and merged.prompt_token_ids[2:] == [edited, edited]
    assert merged.advantages.tolist() == pytest.approx([0.7, -0.7, 0.7, -0.7])
    assert merged.reward_components["agent"].tolist() == [1.0, 0.0, 1.0, 0.0]
    second = ran.split_rows[0][2]
    assert merged.response_ids[2, :len(second.token_ids)].tolist() == second.token_ids
    assert merged.sampler_logprobs[2, :len(second.token_ids)].tolist() == pytest.approx(second.logprobs)


# ------------------------------------------------------------------------------------------------------------ faults
def test_faults_end_their_episode_with_the_fault_reward_and_keep_what_was_sampled(engine, tokenizer):
    modes = ["raise", "sleep", "text", "ok"]
    rows = [{"prompt": "code ?", "code": "4", "id": i, "mode": m} for i, m in enumerate(modes)]
    ran = run(engine, tokenizer, rows, g=1, agent_fn=f"{HERE}.mode_agent", episode_timeout_s=2.0, fault_reward=-0.5)
    ends = [c.episode["end"] for c in ran.completions]
    assert ends[:3] == ["error", "timeout", "bad_output"] and ends[3] in ("answer", "response_budget")
    assert [c.episode["environment_reward"] for c in ran.completions[:3]] == [-0.5] * 3
    assert ran.completions[3].episode["environment_reward"] == 1.0 and not ran.completions[3].episode["faulted"]
    assert "RuntimeError: the tool broke" in ran.completions[0].episode["detail"]
    assert "episode_timeout_s=2.0" in ran.completions[1].episode["detail"]
    for c in ran.completions:  # every episode made one request before its end: its tokens are recorded and trained
        assert c.episode["turns"] >= 1 and sum(c.loss_mask) >= 1


def test_bad_requests_are_refused_naming_the_field_and_the_episode_goes_on(engine, tokenizer):
    modes = ["n2", "temperature", "session", "turns", "long"]
    rows = [{"prompt": "code ?", "code": "4", "id": 10 + i, "mode": m} for i, m in enumerate(modes)]
    run(engine, tokenizer, rows, g=1, agent_fn=f"{HERE}.mode_agent", max_turns=2)
    assert "n=2" in SEEN[10] and "group_size" in SEEN[10]
    assert SEEN[11].startswith("temperature=0.5") and "model.sampling.temperature=1.0" in SEEN[11]
    assert "X-Session-Id 'someone-else'" in SEEN[12]
    assert "max_turns=2" in SEEN[13]
    assert "over model.sampling.max_prompt_length=8" in SEEN[14]


def test_a_streamed_answer_adds_up_to_the_whole_one_tool_calls_included(engine, tokenizer):
    rows = [{"prompt": "code ?", "code": "4", "id": i, "mode": "whole"} for i in range(8)]
    run(engine, tokenizer, rows, g=1, agent_fn=f"{HERE}.mode_agent")
    whole = {i: SEEN.pop(i) for i in range(8)}
    run(engine, tokenizer, [{**r, "mode": "streamed"} for r in rows], g=1, agent_fn=f"{HERE}.mode_agent")  # the same seeds
    assert {i: SEEN.pop(i) for i in range(8)} == whole
    assert any(calls for _, calls in whole.values())  # the tiny model calls the tool within 6 tokens on some seeds
    assert all(name == "lookup" for _, calls in whole.values() for _, _, name, _ in calls)


def test_no_more_episodes_run_at_once_than_max_in_flight(engine, tokenizer):
    RUNNING.update(now=0, most=0)
    rows = [{"prompt": "code ?", "code": "4", "id": 20 + i, "mode": "count"} for i in range(4)]
    ran = run(engine, tokenizer, rows, g=4, agent_fn=f"{HERE}.mode_agent", max_in_flight=3)
    assert RUNNING["most"] == 3 and len(ran.completions) == 16


# ---------------------------------------------------------------------------------------------------------- options
def test_options_name_the_field():
    with pytest.raises(ConfigError, match="agent_fn 'arctic_rl.tasks.agent_toy.score' must name an async function"):
        AgentOptions("arctic_rl.tasks.agent_toy.score")
    with pytest.raises(ConfigError, match="agent_fn 'arctic_rl.tasks.nowhere.agent' cannot be imported"):
        AgentOptions("arctic_rl.tasks.nowhere.agent")
    with pytest.raises(ConfigError, match="max_in_flight must be an integer >= 1"):
        AgentOptions("arctic_rl.tasks.agent_toy.lookup_agent", max_in_flight=0)
    with pytest.raises(ConfigError, match="environment and model.rollout.agent are two ways"):
        RolloutOptions(environment={"env_class": "arctic_rl.tasks.tool_toy.LookupEnvironment"},
                       agent={"agent_fn": "arctic_rl.tasks.agent_toy.lookup_agent"})



def test_what_agent_episodes_do_not_combine_with_is_refused_naming_the_fields(tmp_path):
    agent = RolloutOptions(agent={"agent_fn": "arctic_rl.tasks.agent_toy.lookup_agent"})
    with pytest.raises(ConfigError, match=r"model.rollout.agent takes model.optim.mini_batches 1 .*got 2"):
        ModuleOptions(rollout=agent, optim=OptimOptions(mini_batches=2))
    with pytest.raises(ConfigError, match=r"model.corrections.router_replay does not take model.rollout.agent"):
        ModuleOptions(rollout=agent, corrections=CorrectionConfig(router_replay=True))
    from arctic_rl.cli import build_cli
    from arctic_rl.tasks.agent_toy import write_task
    from tests.helpers import quickstart_config, write_config

    config = quickstart_config(write_task(tmp_path / "task", num_train=8), tmp_path / "run", source="recipes/openai_agent/toy.yaml",
                               **{"trainer.max_steps": 1, "trainer.enable_progress_bar": False})
    config["trainer"]["callbacks"][0]["init_args"].update(max_staleness=2, partial_rollout_tokens=4)
    cli = build_cli(["--config", str(write_config(config, tmp_path / "config.yaml"))], run=False)
    with pytest.raises(ConfigError, match=r"model.rollout.agent does not take RolloutCallback.partial_rollout_tokens"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any step


# ------------------------------------------------------------------------------------------------------ test agents
async def mode_agent(client, row: dict) -> float:
    """One behaviour per row's ``mode``; what it saw goes to ``SEEN[row["id"]]``."""
    mode, messages = row["mode"], [{"role": "user", "content": row["prompt"]}]

    async def ask(msgs, **kw):
        return (await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS, max_tokens=2, **kw)).choices[0].message

    async def refused(**kw) -> str:
        try:
            await client.chat.completions.create(model="policy", messages=messages, max_tokens=2, **kw)
        except openai.BadRequestError as e:
            return e.body["message"] if isinstance(e.body, dict) else str(e)
        return "accepted"

    if mode in ("n2", "temperature", "session", "long"):
        kw = {"n2": {"n": 2}, "temperature": {"temperature": 0.5}, "session": {"extra_headers": {"X-Session-Id": "someone-else"}},
              "long": {"messages": [{"role": "user", "content": "code ? " * 8}]}}[mode]
        if mode == "long":
            messages = kw.pop("messages")
        SEEN[row["id"]] = await refused(**kw)
        await ask([{"role": "user", "content": row["prompt"]}])  # the episode goes on
        return 0.0
    if mode == "count":
        RUNNING["now"] += 1
        RUNNING["most"] = max(RUNNING["most"], RUNNING["now"])
        await ask(messages)
        await asyncio.sleep(0.05)  # held: the others wait for the gate
        RUNNING["now"] -= 1
        return 0.0
    if mode in ("whole", "streamed"):  # the first turn's answer as the SDK gives it: content and tool calls
        asked = dict(model="policy", messages=messages, tools=TOOLS, max_tokens=6)
        if mode == "whole":
            message = (await client.chat.completions.create(**asked)).choices[0].message
            calls = [(k, c.id, c.function.name, c.function.arguments) for k, c in enumerate(message.tool_calls or [])]
            SEEN[row["id"]] = (message.content or "", calls)
            return 0.0
        content, parts = "", {}
        async for chunk in await client.chat.completions.create(**asked, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for c in choice.delta.tool_calls or []:
                    parts[c.index] = (c.index, c.id, c.function.name, c.function.arguments)
        SEEN[row["id"]] = (content, [parts[k] for k in sorted(parts)])
        return 0.0
    first = await ask(messages)
    if mode == "raise":
        raise RuntimeError("the tool broke")
    if mode == "sleep":
        await asyncio.sleep(30)
    if mode == "text":
        return "four"  # type: ignore[return-value]
    if mode == "turns":
        await ask(messages)
        SEEN[row["id"]] = await refused()
        return 0.0
    if mode == "edit":  # the history rewritten: the model's turn replaced by a summary
        await ask(messages + [{"role": "assistant", "content": "4"}, {"role": "user", "content": "code ?"}])
        return 0.0
    return 1.0


# ---------------------------------------------------------------------------------------------------------------- fit
class RecordMetrics:
    """Each step's rollout metrics (a Lightning callback)."""

    def __new__(cls):
        import lightning.pytorch as pl

        class Record(pl.Callback):
            def __init__(self):
                self.steps = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self.steps.append(dict(batch["rollout_metrics"]))

        return Record()


def test_fit_trains_agent_episodes_with_tree_dedup_and_the_one_step_look_ahead(tmp_path):
    from arctic_rl.cli import build_cli
    from arctic_rl.tasks.agent_toy import write_task
    from tests.helpers import quickstart_config, write_config

    config = quickstart_config(write_task(tmp_path / "task", num_train=16), tmp_path / "run", source="recipes/openai_agent/toy.yaml",
                               **{"trainer.max_steps": 3, "trainer.enable_progress_bar": False, "data.init_args.batch_size": 4,
                                  "model.init_args.compute.zorro_dedup": "tree"})
    config["trainer"]["callbacks"][0]["init_args"]["max_staleness"] = 1
    cli = build_cli(["--config", str(write_config(config, tmp_path / "config.yaml"))], run=False)
    record = RecordMetrics()
    cli.trainer.callbacks.append(record)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert len(record.steps) == 3
    for metrics in record.steps:
        assert {"agent/divergences", "agent/split_segments", "rewards/agent/mean", "multi_turn/turns_mean"} <= set(metrics)
    import csv

    logged = [row for row in csv.DictReader(open(tmp_path / "run" / "logs" / "version_0" / "metrics.csv")) if row["sampler_logprob_diff"]]
    assert len(logged) == 3
    # the first step's batch was sampled by the weights it trains: the trainer's log-probs are the endpoint's
    assert float(logged[0]["sampler_logprob_diff"]) < 1e-4, logged[0]["sampler_logprob_diff"]
    # the tree packs each group's shared prompt once
    assert all(float(r["zorro/processed_tokens"]) < float(r["zorro/naive_tokens"]) for r in logged)


@pytest.mark.slow
def test_two_ranks_train_what_one_process_does_with_the_splits_counted_over_both(tmp_path):
    """``trainer.devices: 2``: each rank serves its own endpoint and runs its half of the episodes; every prompt's samples
    depend on its slot in the global batch, so the rewards, loss and gradient norm equal one process's, and the
    per-step counts (``agent/divergences``) are the whole batch's (summed over the ranks, ``step_metrics.over_ranks``)."""
    import csv

    from arctic_rl.tasks.agent_toy import write_task
    from tests.helpers import quickstart_config, run_cli

    task, runs = write_task(tmp_path / "task", num_train=16), {}
    for devices in (1, 2):
        config = quickstart_config(task, tmp_path / f"d{devices}", source="recipes/openai_agent/toy.yaml",
                                   **{"trainer.max_steps": 3, "trainer.enable_progress_bar": False, "trainer.devices": devices,
                                      "data.init_args.batch_size": 4 // devices})
        if devices > 1:
            config["trainer"]["strategy"] = {"class_path": "arctic_rl.strategies.ArcticStrategy", "init_args": {"stage": 2}}
        done = run_cli(config, tmp_path / f"d{devices}.yaml", timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        (path,) = (tmp_path / f"d{devices}").glob("logs/version_*/metrics.csv")
        runs[devices] = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(open(path)) if r.get("reward")]
    one, two = runs[1], runs[2]
    assert [r["step"] for r in two] == [r["step"] for r in one] == [0, 1, 2]
    assert any(r["grad_norm"] > 0 for r in one)  # some step learned: the comparison below is not of zeros only
    assert sum(r["agent/divergences"] for r in one) > 0
    for a, b in zip(one, two):
        assert b["reward"] == pytest.approx(a["reward"], abs=1e-6)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        for key in ("agent/divergences", "agent/split_segments", "multi_turn/turns_mean", "response_length/mean"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
