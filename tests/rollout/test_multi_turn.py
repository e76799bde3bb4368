"""Multi-turn rollouts (``rollout/multi_turn.py``, ``rollout/environment.py``): token-in / token-out with the real
transformers engine, the turn loop's budgets, and faults (a tool that raises, hangs or answers too much) that end
one episode with its reason and reward while the others go on, counted in the metrics."""

from __future__ import annotations

import time

import pytest
import torch

from arctic_rl.data.prompts import PROMPT, PROMPT_IDS
from arctic_rl.errors import ConfigError
from arctic_rl.modules.options import RolloutOptions, SamplingOptions
from arctic_rl.rollout.engines.base import Completion, SamplingConfig
from arctic_rl.rollout.environment import StepResult, ToolEnvironment
from arctic_rl.rollout.generation import generate_rollout
from arctic_rl.rollout.multi_turn import EnvironmentOptions, check_environment, run_episodes
from arctic_rl.rollout.engines.seeds import mix_seed, sample_seed
from arctic_rl.tasks.tool_toy import PROMPT_TEXT, LookupEnvironment, SecretDigitGRPO

HERE = "tests.rollout.test_multi_turn"


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------------------------- token-in / token-out
class RecordingEngine:
    """The real engine, recording each call's contexts, seeds and completions."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def generate(self, prompt_token_ids, sampling):
        out = self.engine.generate(prompt_token_ids, sampling)
        self.calls.append(([list(c) for c in prompt_token_ids], sampling, out))
        return out


def test_the_response_is_the_generated_and_observation_ids_concatenated_never_retokenized(hf_engine, tool_tokenizer):
    tok, g, budget = tool_tokenizer, 4, 16
    rows = [{"prompt": PROMPT_TEXT, "prompt_token_ids": ids(tok, PROMPT_TEXT), "answer": d} for d in ("3", "8", "5", "0")]
    options = EnvironmentOptions(env_class="arctic_rl.tasks.tool_toy.LookupEnvironment", max_turns=3)
    row_seeds = (11, 12, 13, 14)
    engine = RecordingEngine(hf_engine)
    out = run_episodes(engine, options, tok, rows, g, SamplingConfig(n=g, max_tokens=budget, prompt_seeds=row_seeds), len(tok))
    by_seed = {}  # each call's row: its seed -> (context, completion); every (episode, turn) has its own seed
    for contexts, sampling, completions in engine.calls:
        assert sampling.n == 1 and sampling.stop_token_ids == (tok.convert_tokens_to_ids("</tool>"),)
        for context, seed, per_row in zip(contexts, sampling.prompt_seeds, completions):
            assert seed not in by_seed
            by_seed[seed] = (context, per_row[0])
    with_observation = 0
    for e, c in enumerate(out):
        i, k = divmod(e, g)
        prompt = rows[i]["prompt_token_ids"]
        rebuilt, logprobs, mask = [], [], []
        for turn in range(c.episode["turns"]):
            context, generated = by_seed[mix_seed(sample_seed(row_seeds[i], k), turn)]
            assert context == prompt + rebuilt  # the engine is given the running token list, as it grew
            gen = generated.token_ids[: budget - len(rebuilt)]
            rebuilt += gen
            logprobs += generated.logprobs[: len(gen)]
            mask += [1.0] * len(gen)
            if gen[-1:] == ids(tok, "</tool>") and len(c.token_ids) > len(rebuilt):  # the call was answered
                assert c.token_ids[len(rebuilt): len(rebuilt) + 3] == ids(tok, f"<obs> {rows[i]['answer']} </obs>")
                observation = c.token_ids[len(rebuilt): len(rebuilt) + 3]
                rebuilt += observation
                logprobs += [0.0] * 3
                mask += [0.0] * 3
                with_observation += 1
        assert c.token_ids == rebuilt
        assert c.logprobs == logprobs and c.loss_mask == mask  # the sampler's log-probs on generated tokens, 0 elsewhere
        assert c.finish_reason == ("length" if c.episode["truncated"] else "stop")
    assert with_observation >= 2  # the draw (these seeds) does call the tool


def test_a_rollout_batch_has_observation_holes_in_its_loss_mask_and_the_environment_reward(hf_engine, tool_model_dir, tool_tokenizer):
    module = SecretDigitGRPO(model=str(tool_model_dir), sampling=SamplingOptions(group_size=4, max_prompt_length=16, max_response_length=16, seed=2),
                             rollout=RolloutOptions(environment={"env_class": "arctic_rl.tasks.tool_toy.LookupEnvironment", "max_turns": 2}))
    check_environment(module)
    module.configure_model()  # the policy's vocabulary size bounds the environment's token ids
    batch = {PROMPT: [PROMPT_TEXT] * 4, PROMPT_IDS: [ids(tool_tokenizer, PROMPT_TEXT)] * 4, "answer": ["1", "2", "3", "4"]}
    rollout, metrics = generate_rollout(hf_engine, module, batch, step=0)
    obs = rollout.observation_mask
    assert obs is not None and obs.sum() > 0
    assert torch.equal(rollout.response_mask * obs, torch.zeros_like(obs))  # holes: generated xor observation
    seq = rollout.sequence_mask
    lengths = seq.sum(-1).long()
    assert torch.equal(seq, (torch.arange(seq.shape[1])[None] < lengths[:, None]).float())  # a right-padded prefix
    assert torch.equal(rollout.sampler_logprobs * obs, torch.zeros_like(obs))
    assert set(rollout.reward_components) == {"reward", "environment"}
    runs = (rollout.response_mask[:, 0] + (torch.diff(rollout.response_mask, dim=1) > 0).sum(1)).sum().item()
    assert metrics["multi_turn/turns_mean"] == pytest.approx(runs / 16)  # a turn: a run of generated tokens
    assert metrics["response_length/mean"] == pytest.approx(rollout.response_mask.sum(-1).mean().item())  # generated tokens


@pytest.mark.parametrize("compute", [{"zorro_dedup": "group"}, {"zorro_dedup": "tree"}, {"zorro": False}], ids=["group", "tree", "naive"])
def test_the_trainer_scores_tokens_after_an_observation_as_the_sampler_did(hf_engine, tool_model_dir, tool_tokenizer, compute):
    """The forward the loss uses (the observation in the sequence at its own positions) gives the generated tokens,
    those after an observation included, the log-probs the engine sampled them with; observations get 0."""
    module = SecretDigitGRPO(model=str(tool_model_dir), compute=compute,
                             sampling=SamplingOptions(group_size=8, max_prompt_length=16, max_response_length=16, seed=3),
                             rollout=RolloutOptions(environment={"env_class": "arctic_rl.tasks.tool_toy.LookupEnvironment", "max_turns": 2}))
    module.configure_model()
    batch = {PROMPT: [PROMPT_TEXT] * 4, PROMPT_IDS: [ids(tool_tokenizer, PROMPT_TEXT)] * 4, "answer": ["1", "2", "3", "4"]}
    rollout, _ = generate_rollout(hf_engine, module, batch, step=0)
    with torch.no_grad():
        logprobs, _ = module.sequence_logprobs(module.model, rollout)
    after_observation = rollout.response_mask * (torch.cumsum(rollout.observation_mask, dim=1) > 0)
    assert after_observation.sum() >= 5  # this draw (seed 3) has turns after observations
    assert torch.allclose(logprobs * rollout.response_mask, rollout.sampler_logprobs, atol=1e-5)
    assert torch.equal(logprobs * rollout.observation_mask, torch.zeros_like(logprobs))


# ------------------------------------------------------------------------------------------ budgets and faults
class ScriptedEngine:
    """Answers ``</tool>`` to a context that does not end in an observation, else ``answer`` words then EOS, cut
    after the first stop token or EOS as an engine does; a completion longer than ``max_tokens`` is cut there
    ("length"). Log-probs: -0.5 per token."""

    def __init__(self, tokenizer, answer: str = "7", call: str = "</tool>") -> None:
        self.tok, self.answer, self.call = tokenizer, answer, call
        self.turn_lengths: list[int] = []

    def generate(self, prompt_token_ids, sampling):
        out = []
        for context in prompt_token_ids:
            if context[-1] == self.tok.convert_tokens_to_ids("</obs>"):
                tokens = ids(self.tok, self.answer) + [self.tok.eos_token_id]
            else:
                tokens = ids(self.tok, self.call)
            stops = {self.tok.eos_token_id, *sampling.stop_token_ids}
            tokens = tokens[: next(t + 1 for t, tok in enumerate(tokens) if tok in stops)]
            reason = "length" if len(tokens) > sampling.max_tokens else "stop"
            tokens = tokens[: sampling.max_tokens]
            out.append([Completion(tokens, [-0.5] * len(tokens), reason)])
        self.turn_lengths.append(sampling.max_tokens)
        return out


def hang(args: str) -> str:
    time.sleep(60)
    return "never"


def boom(args: str) -> str:
    raise KeyError("no such record")


class FaultyTools(ToolEnvironment):
    """``lookup`` answers; ``x`` raises, ``y`` hangs, ``z`` answers 50 words; ``say`` returns a bad StepResult."""

    tools = {"lookup": lambda args, row: row["answer"], "x": boom, "y": hang, "z": lambda args: " ".join(["1"] * 50)}

    def step(self, generated_ids, text):
        if "say" in self.tokenizer.decode(self.since_observation + generated_ids):
            return "not a StepResult"
        return super().step(generated_ids, text)


def rows_calling(tok, *tools: str) -> list[dict]:
    return [{"prompt": f"<tool> {t}", "prompt_token_ids": ids(tok, f"<tool> {t}"), "answer": "4"} for t in tools]


def episodes(tok, tools, engine=None, g=1, budget=16, **options):
    options = {"env_class": f"{HERE}.FaultyTools", "max_turns": 3, "max_observation_tokens": 8, "step_timeout_s": 0.5,
               "fault_reward": -1.0, **options}
    engine = engine or ScriptedEngine(tok)
    return run_episodes(engine, EnvironmentOptions(**options), tok, rows_calling(tok, *tools), g,
                        SamplingConfig(n=g, max_tokens=budget, seed=0), len(tok))


def test_faults_end_their_episode_with_the_reason_and_fault_reward_and_the_others_go_on(tool_tokenizer, caplog):
    tok = tool_tokenizer
    with caplog.at_level("WARNING"):
        out = episodes(tok, ["lookup", "x", "y", "z", "say", "copy"])
    ends = [c.episode["end"] for c in out]
    assert ends == ["answer", "error", "timeout", "observation_budget", "bad_output", "answer"]
    assert [c.episode["faulted"] for c in out] == [False, True, True, True, True, False]
    assert [c.episode["environment_reward"] for c in out] == [0.0, -1.0, -1.0, -1.0, -1.0, 0.0]
    assert "KeyError" in out[1].episode["detail"] and "0.5 s" in out[2].episode["detail"] and "52 observation tokens" in out[3].episode["detail"]
    # the healthy episode: call, observation (masked), answer; an unknown tool is answered with an error observation
    assert out[0].token_ids == ids(tok, "</tool> <obs> 4 </obs> 7") + [tok.eos_token_id]
    assert out[0].loss_mask == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert tok.decode(out[5].token_ids[1:-2]) == "<obs> <unk> <unk> copy </obs>"  # "unknown tool copy", word-level
    for faulted in out[1:5]:  # ended at the call: its generated turn is kept, nothing of the tool's
        assert faulted.token_ids == ids(tok, "</tool>") and faulted.loss_mask == [1.0]
    assert "4 of 6 episodes ended by a fault" in caplog.text


def test_fault_metrics_count_each_kind_and_the_batch_trains_on(tool_model_dir, tool_tokenizer):
    from arctic_rl.rollout.multi_turn import multi_turn_metrics

    out = episodes(tool_tokenizer, ["lookup", "x", "y", "y", "z", "lookup"])
    metrics = multi_turn_metrics(out)
    assert (metrics["multi_turn/fault_error"], metrics["multi_turn/fault_timeout"], metrics["multi_turn/fault_observation_budget"],
            metrics["multi_turn/fault_bad_output"]) == (1.0, 2.0, 1.0, 0.0)
    assert metrics["multi_turn/fault_frac"] == pytest.approx(4 / 6)
    assert metrics["multi_turn/turns_mean"] == pytest.approx((2 + 1 + 1 + 1 + 1 + 2) / 6)
    assert metrics["multi_turn/end_answer_frac"] == pytest.approx(2 / 6)


def test_budgets_max_turns_response_tokens_and_observation_cap(tool_tokenizer):
    tok = tool_tokenizer
    engine = ScriptedEngine(tok, answer="</tool>")  # answers a call with another call: only max_turns ends it
    out = episodes(tok, ["lookup"], engine=engine, max_turns=2)[0]
    assert out.episode["end"] == "max_turns" and out.episode["turns"] == 2
    # the second call names no tool (its turn has no <tool>, nor has the context since the observation): an error observation
    assert out.token_ids == ids(tok, "</tool> <obs> 4 </obs> </tool> <obs> unknown tool </obs>")
    # the response budget counts observation tokens: 1 + 3 + 1 = 5 of 6, no room for the next observation
    out = episodes(tok, ["lookup"], engine=ScriptedEngine(tok, answer="</tool>"), max_turns=5, budget=6)[0]
    assert (out.episode["end"], out.finish_reason) == ("response_budget", "length")
    assert out.token_ids == ids(tok, "</tool> <obs> 4 </obs> </tool>")
    # an answer longer than what is left is cut at the budget: truncated
    out = episodes(tok, ["lookup"], engine=ScriptedEngine(tok, answer="1 2 3 4 5"), budget=7)[0]
    assert (out.episode["end"], out.finish_reason, len(out.token_ids)) == ("response_budget", "length", 7)
    assert out.token_ids[-3:] == ids(tok, "1 2 3")
    # each turn is offered the budget left
    engine = ScriptedEngine(tok)
    episodes(tok, ["lookup"], engine=engine, budget=10)
    assert engine.turn_lengths == [10, 6]
    # one observation over max_observation_tokens is a fault, even with response budget to spare
    out = episodes(tok, ["lookup"], max_observation_tokens=2)[0]
    assert out.episode["end"] == "observation_budget" and out.episode["faulted"]


def test_environment_options_name_the_bad_field():
    with pytest.raises(ConfigError, match=r"model.rollout.environment.env_class 'no.such.Env' cannot be imported"):
        EnvironmentOptions(env_class="no.such.Env")
    with pytest.raises(ConfigError, match=r"model.rollout.environment.max_turns must be an integer >= 1, got 0"):
        EnvironmentOptions(env_class="arctic_rl.tasks.tool_toy.LookupEnvironment", max_turns=0)
    with pytest.raises(ConfigError, match=r"model.rollout.environment.step_timeout_s"):
        EnvironmentOptions(env_class="arctic_rl.tasks.tool_toy.LookupEnvironment", step_timeout_s=0)
    with pytest.raises(ConfigError, match=r"env_class 'builtins.dict': the class has no reset\(\)"):
        EnvironmentOptions(env_class="builtins.dict")
    with pytest.raises(ConfigError, match=r"model.rollout.environment.max_turns"):
        RolloutOptions(environment={"env_class": "arctic_rl.tasks.tool_toy.LookupEnvironment", "max_turns": -1})


def test_a_stop_string_must_be_one_token(tool_tokenizer):
    with pytest.raises(ConfigError, match=r"env_args.stop 'end of call' must be one token"):
        LookupEnvironment(tokenizer=tool_tokenizer, stop="end of call")


def test_tool_environment_parses_a_call_opened_in_the_turn_or_the_prompt(tool_tokenizer):
    tok = tool_tokenizer
    env = LookupEnvironment(tokenizer=tok)
    env.reset({"prompt_token_ids": ids(tok, "say the digit"), "answer": "9"})
    result = env.step(ids(tok, "x <tool> lookup now </tool>"), "x <tool> lookup now </tool>")
    assert isinstance(result, StepResult) and result.observation_ids == ids(tok, "<obs> 9 </obs>")
    assert result.info == {"tool": "lookup"} and (result.reward, result.done) == (0.0, False)
    assert env.parse_call("<tool> lookup a b </tool>") == ("lookup", "a b")
    env.reset({"prompt_token_ids": ids(tok, PROMPT_TEXT), "answer": "2"})  # the prompt opens the call
    assert env.step(ids(tok, "</tool>"), "</tool>").observation_ids == ids(tok, "<obs> 2 </obs>")
