"""Agent rollouts (``model.rollout.agent``): each sample is an episode of the user's ``async def agent(client, row) ->
float``, run against the OpenAI-compatible endpoint on loopback (``agent_server.py``), which samples with the run's
engine and records every token it rendered and sampled.

One rollout batch: ``group_size`` episodes of each row, at most ``max_in_flight`` at once on one event loop, each
with its own session (its ``client`` sends it as ``X-Session-Id``) and cancelled after ``episode_timeout_s``. When
all have ended, their recorded episodes become one ``Completion`` each, as a multi-turn episode's:

- the prompt is the first request's prompt; the response is every later token, sampled (loss mask 1, the sampler's
  log-probs) or the environment's (mask 0: the template's framing, tool results, the next user message);
- the G episodes of a row share their prompt: the longest common prefix of their first prompts (the rest of an
  episode's first prompt opens its response, mask 0);
- an episode whose later turn did not re-render its history token for token was split by the endpoint
  (``episodes.py``): its first sequence is its sample, and each later one (its own prompt, as that request rendered
  it) is trained as a row of its own after the batch's groups, with the episode's advantage (``with_split_rows``);
  the splits are counted (``agent/divergences``, ``agent/split_segments``) and logged once a batch;
- its reward is what the agent returned (the named reward ``agent``; the module's own ``reward`` is added when it
  overrides it). An agent that raised, timed out or returned something other than a finite number is a fault
  (``fault_reward``, counted in ``multi_turn/fault_*``, one warning per batch); its recorded tokens are trained.

An engine failure stops the run (it is not a fault of the episode).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from arctic_rl.errors import ServiceError
from arctic_rl.options.rollout import AgentOptions, agent_function
from arctic_rl.rollout.batch import RolloutBatch
from arctic_rl.rollout.engines.base import Completion, RolloutEngine, SamplingConfig
from arctic_rl.rollout.engines.seeds import resolve_prompt_seeds, sample_seed
from arctic_rl.rollout.openai.agent_server import AgentServer, agent_server
from arctic_rl.rollout.openai.episodes import Episode

log = logging.getLogger(__name__)

AGENT = "agent"  # the name of the agent's reward among the named rewards
RECORD_WAIT_S = 600.0  # after the last episode: how long its requests still being sampled may take


@dataclass
class _Outcome:
    end: str  # "answer" (the agent returned), or a fault: "error", "timeout", "bad_output"
    reward: float
    detail: str = ""


@dataclass
class AgentRollout:
    completions: list[Completion]  # one per episode (its first sequence), the G of a row contiguous
    prompt_token_ids: list[list[int]]  # one per row
    split_rows: list[tuple[int, list[int], Completion]]  # (episode, prompt ids, completion): the later sequences


def run_agents(engine: RolloutEngine, options: AgentOptions, tokenizer, rows: list[dict[str, Any]], row_prompts: list[list[int]],
               group_size: int, sampling: SamplingConfig, max_prompt_length: int) -> AgentRollout:
    """``group_size`` episodes of each of ``rows`` (``row_prompts``: their prompt ids, used only for a row none of whose
    episodes made a request); ``sampling``: the run's temperature, top-p, seeds and the per-episode response budget
    (``max_tokens``). Returns the episodes as completions with their prompts."""
    agent = agent_function(options.agent_fn)
    server = agent_server(tokenizer, options.max_in_flight)
    server.sampler.engine = engine
    server.sampler.temperature, server.sampler.top_p = sampling.temperature, sampling.top_p
    row_seeds = resolve_prompt_seeds(sampling.seed, sampling.prompt_seeds, len(rows))
    batch = uuid.uuid4().hex[:8]
    sessions = [f"{batch}-{i}-{k}" for i in range(len(rows)) for k in range(group_size)]
    seeds = {sid: None if row_seeds is None else sample_seed(row_seeds[j // group_size], j % group_size)
             for j, sid in enumerate(sessions)}
    server.episodes.open(seeds, max_prompt_length, sampling.max_tokens, options.max_turns, sampling.temperature, sampling.top_p)
    try:
        outcomes = asyncio.run(_run_all(agent, server, options, [rows[j // group_size] for j in range(len(sessions))], sessions))
    finally:
        admitted = server.episodes.close()
    recorded = _take_recorded(server, sessions, {sid: s.requests for sid, s in admitted.items()})
    if all(not e.segments for e in recorded):
        first = next((o for o in outcomes if o.detail), None)
        raise RuntimeError(f"model.rollout.agent: no episode of the batch made a completion request (agent_fn {options.agent_fn})"
                           + (f"; first fault: {first.end}: {first.detail}" if first else ""))
    _warn(outcomes, options.fault_reward)
    return _completions(recorded, outcomes, admitted, sessions, row_prompts, group_size, options.fault_reward, tokenizer)


async def _run_all(agent, server: AgentServer, options: AgentOptions, rows: list[dict], sessions: list[str]) -> list[_Outcome]:
    import httpx
    import openai

    # a kept-alive connection per episode in flight: no episode opens a new one per request
    limits = httpx.Limits(max_connections=options.max_in_flight, max_keepalive_connections=options.max_in_flight)
    client = openai.AsyncOpenAI(base_url=server.url, api_key=server.token, max_retries=0,
                                timeout=options.episode_timeout_s or 3600.0,
                                http_client=openai.DefaultAsyncHttpxClient(limits=limits))
    gate = asyncio.Semaphore(options.max_in_flight)

    async def one(row: dict, session: str) -> _Outcome:
        async with gate:
            server.sampler.add_live(1)
            try:
                episode = agent(client.with_options(default_headers={"X-Session-Id": session}), dict(row))
                reward = await asyncio.wait_for(episode, options.episode_timeout_s)
            except asyncio.TimeoutError:
                return _Outcome("timeout", options.fault_reward, f"ran past model.rollout.agent.episode_timeout_s={options.episode_timeout_s}")
            except Exception as e:  # noqa: BLE001  (the agent's failure is its episode's fault)
                return _Outcome("error", options.fault_reward, f"{type(e).__name__}: {e}")
            finally:
                server.sampler.add_live(-1)
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                return _Outcome("bad_output", options.fault_reward, f"returned {reward!r}, not a finite number (the reward)")
            return _Outcome("answer", float(reward))

    try:
        return await asyncio.gather(*(one(row, sid) for row, sid in zip(rows, sessions)))
    finally:
        await client.close()


def _take_recorded(server: AgentServer, sessions: list[str], admitted: dict[str, int]) -> list[Episode]:
    """Each session's recorded episode, removed from the store, once every admitted request is recorded (a cancelled
    episode's last request is still sampled and recorded: a truncated episode, not lost)."""
    store = server.service.store
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        if server.sampler.failure is not None:
            failure = server.sampler.failure
            server.sampler.failure = None
            _forget(store, sessions)
            raise RuntimeError(f"the rollout engine failed while agents sampled: {type(failure).__name__}: {failure}") from failure
        if all(_recorded_turns(store, sid) >= admitted.get(sid, 0) for sid in sessions):
            break
        if time.monotonic() > deadline:
            _forget(store, sessions)
            raise RuntimeError(f"agent rollouts: requests still unanswered {RECORD_WAIT_S:.0f} s after the batch's episodes ended")
        time.sleep(0.005)
    return [_pop(store, sid) for sid in sessions]


def _recorded_turns(store, session: str) -> int:
    try:
        return sum(s.turns for s in store.get(session).segments)
    except ServiceError:  # no request recorded yet
        return 0


def _pop(store, session: str) -> Episode:
    try:
        return store.pop([session])[0]
    except ServiceError:
        return Episode()


def _forget(store, sessions: list[str]) -> None:
    for sid in sessions:
        _pop(store, sid)


def _completions(recorded: list[Episode], outcomes: list[_Outcome], admitted: dict, sessions: list[str],
                 row_prompts: list[list[int]], g: int, fault_reward: float, tokenizer) -> AgentRollout:
    completions, prompts, split = [], [], []
    for i in range(len(row_prompts)):
        group = recorded[i * g:(i + 1) * g]
        firsts = [e.segments[0].prompt_ids for e in group if e.segments]
        prompt = _common_prefix(firsts) if firsts else list(row_prompts[i])
        if not prompt:
            raise RuntimeError(f"model.rollout.agent: the {g} episodes of row {i} of the batch share no first prompt token;"
                               " a row's episodes must open with the same tokens (the same first messages)")
        prompts.append(prompt)
        for k, episode in enumerate(group):
            j = i * g + k
            completions.append(_completion(episode, outcomes[j], admitted.get(sessions[j]), prompt, fault_reward, tokenizer))
            split += [(j, list(s.prompt_ids), Completion(list(s.response_ids), list(s.logprobs), s.finish_reason, list(s.loss_mask)))
                      for s in episode.segments[1:]]
    return AgentRollout(completions, prompts, split)


def _completion(episode: Episode, outcome: _Outcome, session, prompt: list[int], fault_reward: float, tokenizer) -> Completion:
    faulted = outcome.end != "answer"
    if episode.segments:
        first = episode.segments[0]
        head = first.prompt_ids[len(prompt):]  # the part of its first prompt its group does not share
        ids = head + first.response_ids
        mask = [0] * len(head) + list(first.loss_mask)
        logprobs = [0.0] * len(head) + list(first.logprobs)
        finish = first.finish_reason
    else:  # no request: one end-of-sequence token, read by the forward and never trained
        ids, mask, logprobs, finish = [tokenizer.eos_token_id], [0], [0.0], "stop"
    truncated = session is not None and (session.budget_refused or (session.last_cut_by_budget and finish == "length"))
    end = outcome.end if faulted else ("response_budget" if truncated else "answer")
    text = None  # a split episode's text: its last sequence, whose prompt holds the whole history as last rendered
    if len(episode.segments) > 1:
        text = tokenizer.decode(episode.segments[-1].token_ids[len(prompt):], skip_special_tokens=True)
    record = {"turns": sum(s.turns for s in episode.segments), "end": end, "detail": outcome.detail, "faulted": faulted,
              "truncated": truncated, "environment_reward": fault_reward if faulted else outcome.reward,
              "observation_tokens": len(mask) - sum(mask), "infos": [], "abandoned_steps": 0,
              "divergences": episode.divergences, "split_segments": max(len(episode.segments) - 1, 0), "agent": True,
              "text": text}
    return Completion(ids, logprobs, "length" if truncated else "stop", mask, record)


def _common_prefix(sequences: list[list[int]]) -> list[int]:
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for position in range(n):
        if any(s[position] != first[position] for s in sequences):
            return list(first[:position])
    return list(first[:n])


def _warn(outcomes: list[_Outcome], fault_reward: float) -> None:
    faults = Counter(o.end for o in outcomes if o.end != "answer")
    if faults:
        first = next(o for o in outcomes if o.end != "answer")
        log.warning("agent rollouts: %d of %d episodes ended by a fault %s (reward %g); first: %s: %s", sum(faults.values()),
                    len(outcomes), dict(faults), fault_reward, first.end, first.detail)


def agent_metrics(completions: list[Completion]) -> dict[str, float]:
    """``agent/*`` of a batch of agent episodes (empty otherwise): the turns whose prompt did not extend the episode
    (``divergences``) and the sequences split off by them, trained as rows of their own (``split_segments``), summed."""
    records = [c.episode for c in completions if c.episode is not None and c.episode.get("agent")]
    if not records:
        return {}
    split = sum(r["split_segments"] for r in records)
    if split:
        log.warning("agent rollouts: %d episodes re-rendered a turn to other tokens than were sampled; their %d later"
                    " sequences train as rows of their own (docs/agents.md, 'Training an agent with fit')",
                    sum(r["divergences"] > 0 for r in records), split)
    return {"agent/divergences": float(sum(r["divergences"] for r in records)), "agent/split_segments": float(split)}


def episode_text(completion: Completion, decoded: str) -> str:
    """The text an episode's rewards and ``is_correct`` read: for a split episode, the conversation as its last request
    rendered it; for any other completion (an episode that was not split included), ``decoded``: its response."""
    record = completion.episode
    if record is None or not record.get("agent") or record.get("text") is None:
        return decoded
    return record["text"]


def with_split_rows(rollout: RolloutBatch, split_rows: list[tuple[int, list[int], Completion]], tokenizer) -> RolloutBatch:
    """``rollout`` with each split-off sequence appended as a row: its own prompt and tokens (mask 0 on the
    environment's), its episode's reward, named rewards and advantage."""
    index = torch.tensor([e for e, _, _ in split_rows], dtype=torch.long)
    outs = [c for _, _, c in split_rows]
    width = max(len(c.token_ids) for c in outs)
    ids = torch.full((len(outs), width), tokenizer.pad_token_id, dtype=torch.long)
    mask, sampler, observation = (torch.zeros((len(outs), width)) for _ in range(3))
    for i, c in enumerate(outs):
        n = len(c.token_ids)
        ids[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        mask[i, :n] = torch.tensor(c.loss_mask, dtype=torch.float32)
        observation[i, :n] = 1.0 - mask[i, :n]
        sampler[i, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
    extra = RolloutBatch(
        prompt_token_ids=[p for _, p, _ in split_rows], response_ids=ids, response_mask=mask, sampler_logprobs=sampler,
        rewards=rollout.rewards[index], advantages=rollout.advantages[index], group_size=rollout.group_size,
        truncated=None if rollout.truncated is None else torch.tensor([c.finish_reason == "length" for c in outs]),
        prompts=[rollout.prompts[e] for e, _, _ in split_rows] if rollout.prompts else [],
        completions=tokenizer.batch_decode([c.token_ids for c in outs], skip_special_tokens=True) if rollout.completions else [],
        reward_components={k: v[index] for k, v in rollout.reward_components.items()},
        observation_mask=observation if rollout.observation_mask is not None else None,
    )
    return RolloutBatch.concat([rollout, extra])
