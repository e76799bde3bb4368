"""The OpenAI-compatible endpoint (``arctic-rl serve --api openai``) with the real ``openai`` SDK against one real
server on loopback (the tiny Qwen3, the transformers engine): chat with tools, ``n > 1`` and streaming sample what the
core samples and record those exact tokens, whose log-probs are the trainer's forward's; a second turn that re-renders
the first grows one sequence, one that does not is split and counted; bad requests are 4xx naming the field; a client
that leaves mid-stream leaves its episode recorded as sampled up to where the engine stopped; ``collect`` gives the
``TrainBatch``. (Streaming as the engine decodes, with the engine held at known steps: ``test_openai_stream.py``.)"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from arctic_rl import ArcticRLClient  # noqa: E402
from arctic_rl.rollout.engines.base import Completion  # noqa: E402
from arctic_rl.serve import wire  # noqa: E402
from arctic_rl.serve.batch import TrainBatch  # noqa: E402
from arctic_rl.serve.errors import ServiceError  # noqa: E402
from arctic_rl.serve.openai.remote import collect_episodes  # noqa: E402
from arctic_rl.rollout.openai.fields import parse_tool_calls  # noqa: E402
from arctic_rl.rollout.openai.service import OpenAIService  # noqa: E402
from arctic_rl.serve.server import start_server_process  # noqa: E402

# A chat template over the toy vocabulary that renders tools and tool calls; every message ends with the end token,
# so a completion that stopped there re-renders to the same tokens.
TEMPLATE = ("{% if tools %}<|im_start|> system {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<|endoftext|> "
            "{% endif %}{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }}{% for c in m.get('tool_calls') "
            "or [] %} {{ c['function']['name'] }} {{ c['function']['arguments']['digit'] }}{% endfor %} <|endoftext|> "
            "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
TOOLS = [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {"digit": {"type": "string"}}}}}]
TOOL_TURN = [{"role": "user", "content": "please echo 7"},
             {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "type": "function",
                                                                  "function": {"name": "echo", "arguments": '{"digit": "7"}'}}]},
             {"role": "tool", "tool_call_id": "c0", "content": "7"}]
AS_TEMPLATED = [TOOL_TURN[0], {**TOOL_TURN[1], "tool_calls": [{"id": "c0", "type": "function",  # arguments parsed
                                                               "function": {"name": "echo", "arguments": {"digit": "7"}}}]},
                TOOL_TURN[2]]
MAX_PROMPT, MAX_RESPONSE = 48, 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoTokenizer

    from arctic_rl.tasks.toy import write_tiny_model

    root = tmp_path_factory.mktemp("openai-api")
    model = write_tiny_model(root / "model", seed=0)
    shutil.copytree(model, root / "tokenizer", ignore=shutil.ignore_patterns("*.safetensors", "config.json", "generation_config.json"))
    (root / "tokenizer" / "chat_template.jinja").write_text(TEMPLATE)
    config = {"model": str(model), "tokenizer": str(root / "tokenizer"), "training": {"accelerator": "cpu"},
              "engines": {"engine": "transformers"},
              "sampling": {"max_prompt_length": MAX_PROMPT, "max_response_length": MAX_RESPONSE},
              "server": {"root_dir": str(root / "root")}}
    proc = start_server_process(config, api="openai", startup_timeout_s=300)
    proc.tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    proc.sdk = openai.OpenAI(base_url=f"{proc.url}/v1", api_key=proc.token, max_retries=0)
    proc.core = ArcticRLClient({"protocol": "http", "server_url": proc.url, "auth_token": proc.token})
    yield proc
    proc.core.close()
    proc.stop()


def episode(server, session: str) -> dict:
    reply = httpx.get(f"{server.url}/v1/episodes/{session}", headers={"Authorization": f"Bearer {server.token}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def collect(server, sessions: list[str], rewards: list[float], group: bool = False) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/episodes/collect", json={"session_ids": sessions, "rewards": rewards, "group": group},
                      headers={"Authorization": f"Bearer {server.token}"})


def as_batch(reply: httpx.Response) -> TrainBatch:
    assert reply.status_code == 200, reply.text
    return TrainBatch.from_message(wire.decode(reply.content).message)


def ids_of(server, content: list) -> list[int]:
    return server.tokenizer.convert_tokens_to_ids([t.token for t in content])


def test_chat_with_tools_n_and_streaming_record_what_the_core_samples(server):
    prompt = server.tokenizer.apply_chat_template(AS_TEMPLATED, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    want_prompt = server.tokenizer.encode(prompt, add_special_tokens=False)
    assert prompt.count("echo") == 3 and prompt.count("7") == 3  # the tools, the tool call and its result were rendered
    asked = dict(model="m", messages=TOOL_TURN, tools=TOOLS, n=3, max_tokens=MAX_RESPONSE, seed=11, logprobs=True)
    reply = server.sdk.chat.completions.create(**asked, extra_headers={"X-Session-Id": "tools"})
    assert reply.usage.prompt_tokens == len(want_prompt) and len(reply.choices) == 3
    recorded = episode(server, "tools")
    assert [s["prompt_ids"] for s in recorded["segments"]] == [want_prompt] * 3 and recorded["divergences"] == 0
    same = server.core.sample([want_prompt], n=3, max_tokens=MAX_RESPONSE, seed=11)  # the core's own sample, same seed
    assert [s["response_ids"] for s in recorded["segments"]] == same.token_ids[0]
    assert [ids_of(server, c.logprobs.content) for c in reply.choices] == same.token_ids[0]
    assert [s["versions"] for s in recorded["segments"]] == [[0] * len(t) for t in same.token_ids[0]]

    stream = server.sdk.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True}, user="tools-streamed")
    text, tokens = ["", "", ""], [[], [], []]
    for chunk in stream:
        usage = chunk.usage
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            tokens[choice.index] += ids_of(server, choice.logprobs.content) if choice.logprobs else []
    assert tokens == same.token_ids[0] and text == [c.message.content for c in reply.choices]
    assert usage.completion_tokens == sum(map(len, tokens)) and usage.prompt_tokens == len(want_prompt)  # the last chunk's

    batch = collect_episodes(server.url, server.token, ["tools", "tools-streamed"], [1.0, 0.0], group=True)
    assert batch.num_sequences == 6 and batch.prompt_token_ids == [want_prompt] * 6
    a = 0.5 / (0.5 ** 0.5 + 1e-4)  # GRPO over the two sessions: (r - mean) / (unbiased std + 1e-4)
    assert batch.advantages.tolist() == pytest.approx([a, a, a, -a, -a, -a], abs=1e-6)
    forward = server.core.forward(batch, ["logprobs"])["logprobs"]
    mask = batch.response_mask.bool()
    # the transformers engine and the trainer run the same float32 model: equal to 1e-6 (vLLM's tests allow 1e-3)
    torch.testing.assert_close(batch.sampler_logprobs[mask], forward[mask], rtol=0, atol=1e-6)


def test_a_second_turn_that_re_renders_the_first_grows_one_sequence_else_splits(server):
    turn = [{"role": "user", "content": "say 3"}]
    first = server.sdk.chat.completions.create(model="m", messages=turn, n=4, max_tokens=3, seed=5, user="grow")
    segments = episode(server, "grow")["segments"]
    # the random model also samples special tokens, which no text can carry back: continue a choice of plain words
    plain = [i for i, s in enumerate(segments) if all(t >= 9 for t in s["response_ids"])]
    assert plain, segments  # seed 5 samples one (the model and the engine's seeding are fixed)
    chosen = segments[plain[0]]
    second_turn = turn + [{"role": "assistant", "content": first.choices[plain[0]].message.content},
                          {"role": "user", "content": "now echo 5"}]
    rendered = server.tokenizer.encode(server.tokenizer.apply_chat_template(second_turn, add_generation_prompt=True, tokenize=False),
                                       add_special_tokens=False)
    earlier = chosen["prompt_ids"] + chosen["response_ids"]
    assert rendered[: len(earlier)] == earlier  # the second turn re-renders the first to the same tokens
    server.sdk.chat.completions.create(model="m", messages=second_turn, max_tokens=4, seed=6, user="grow")
    after = episode(server, "grow")
    assert len(after["segments"]) == 4 and after["divergences"] == 0
    seq, n1, environment = after["segments"][plain[0]], len(chosen["response_ids"]), rendered[len(earlier):]
    grown = len(seq["response_ids"]) - n1 - len(environment)
    assert seq["prompt_ids"] == chosen["prompt_ids"] and seq["turns"] == 2 and 1 <= grown <= 4
    assert seq["response_ids"][: n1 + len(environment)] == chosen["response_ids"] + environment
    assert seq["loss_mask"] == [1] * n1 + [0] * len(environment) + [1] * grown
    assert seq["logprobs"][:n1] == chosen["logprobs"] and seq["logprobs"][n1: n1 + len(environment)] == [0.0] * len(environment)
    assert [s["turns"] for s in after["segments"]] == [2 if i == plain[0] else 1 for i in range(4)]

    edited = turn + [{"role": "assistant", "content": "x y z"}, {"role": "user", "content": "now echo 5"}]
    server.sdk.chat.completions.create(model="m", messages=edited, max_tokens=4, seed=6, user="grow")
    split = episode(server, "grow")
    assert len(split["segments"]) == 5 and split["divergences"] == 1 and split["segments"][4]["turns"] == 1
    assert split["segments"][plain[0]] == seq  # the grown sequence is kept as it was
    batch = as_batch(collect(server, ["grow"], [0.5]))
    assert batch.num_sequences == 5 and batch.advantages.tolist() == [0.5] * 5
    assert batch.response_mask[plain[0]].tolist()[: len(seq["loss_mask"])] == seq["loss_mask"]
    with pytest.raises(ServiceError, match="no recorded episode") as gone:  # collected once, then gone
        collect_episodes(server.url, server.token, ["grow"], [0.5])
    assert gone.value.status == 404


def refused(server, status: int, field: str, param: str | None = "", **request) -> None:
    """The request is refused with ``status``, its message naming ``field`` and its ``param`` (default: ``field``)."""
    with pytest.raises(openai.APIStatusError) as caught:
        server.sdk.chat.completions.create(model="m", **request)
    assert caught.value.status_code == status and field in caught.value.message, caught.value.message
    assert caught.value.param == (field if param == "" else param), caught.value.body


def test_bad_requests_name_the_field_and_touch_no_session(server):
    ok = [{"role": "user", "content": "say 3"}]
    refused(server, 400, "messages[0].role", messages=[{"role": "robot", "content": "x"}], user="bad")
    refused(server, 400, "messages", messages=[], user="bad")
    refused(server, 400, "session id", None, messages=ok)
    bad_call = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                                     "function": {"name": "echo", "arguments": "{digit: 7"}}]}]
    refused(server, 400, "messages[0].tool_calls[0].function.arguments", messages=bad_call, user="bad")
    refused(server, 400, "max_prompt_length", "messages", messages=[{"role": "user", "content": "echo " * 60}], user="bad")
    refused(server, 400, "max_tokens", messages=ok, max_tokens=MAX_RESPONSE + 1, user="bad")
    refused(server, 400, "stop", messages=ok, stop=["echo 7"], user="bad")
    refused(server, 400, "top_logprobs", messages=ok, logprobs=True, top_logprobs=2, user="bad")
    refused(server, 400, "n", messages=ok, n=0, user="bad")
    refused(server, 400, "frobnicate", messages=ok, user="bad", extra_body={"frobnicate": 1})  # nothing silently dropped
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="m", messages=ok, user="bad")
    assert httpx.get(f"{server.url}/v1/episodes/bad", headers={"Authorization": f"Bearer {server.token}"}).status_code == 404
    assert collect(server, ["never-seen"], [1.0]).status_code == 404
    assert "rewards" in collect(server, ["x"], [1.0, 2.0]).json()["error"]["message"]


def test_a_client_that_leaves_mid_stream_leaves_its_episode_recorded(server):
    """The client leaves after the first chunk, at some step of the engine's (``test_openai_stream.py`` holds the
    engine to leave at a known one): each completion is recorded as sampled up to where the engine stopped, a start of
    the same seed's whole sample, and one that was cut is flagged ``client_disconnected``."""
    body = {"model": "m", "messages": [{"role": "user", "content": "echo 9"}], "n": 2, "max_tokens": MAX_RESPONSE,
            "stream": True, "seed": 3, "user": "leaver"}
    auth = {"Authorization": f"Bearer {server.token}"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=auth) as reply:
        assert reply.status_code == 200
        first = next(reply.iter_lines())
        assert first.startswith("data: ") and json.loads(first[6:])["object"] == "chat.completion.chunk"
    deadline = time.monotonic() + 120  # a hang guard: the episode is recorded once the engine has stopped
    while httpx.get(f"{server.url}/v1/episodes/leaver", headers=auth).status_code == 404:
        assert time.monotonic() < deadline, "the episode of the client that left was never recorded"
        time.sleep(0.02)
    recorded = episode(server, "leaver")
    prompt = recorded["segments"][0]["prompt_ids"]
    same = server.core.sample([prompt], n=2, max_tokens=MAX_RESPONSE, seed=3)
    for segment, ids, logprobs in zip(recorded["segments"], same.token_ids[0], same.logprobs[0], strict=True):
        kept = len(segment["response_ids"])
        assert kept >= 1 and segment["response_ids"] == ids[:kept]
        assert segment["logprobs"] == pytest.approx(logprobs[:kept], abs=1e-6)
        assert segment["client_disconnected"] or kept == len(ids)  # cut only because the client left
    # the server goes on answering, and the other sessions are untouched
    text = server.sdk.completions.create(model="m", prompt="say 4", max_tokens=2, logprobs=1, user="after-leaver")
    [after] = episode(server, "after-leaver")["segments"]
    assert after["prompt_ids"] == server.tokenizer.encode("say 4", add_special_tokens=False) and 1 <= len(after["response_ids"]) <= 2
    assert server.tokenizer.convert_tokens_to_ids(text.choices[0].logprobs.tokens) == after["response_ids"]
    assert text.choices[0].logprobs.token_logprobs == after["logprobs"] and not after["client_disconnected"]
    assert len(episode(server, "leaver")["segments"]) == 2
    assert httpx.delete(f"{server.url}/v1/episodes/leaver", headers=auth).status_code == 200
    assert httpx.get(f"{server.url}/v1/episodes/leaver", headers=auth).status_code == 404
    assert len(episode(server, "after-leaver")["segments"]) == 1  # only the dropped session is gone


def test_parse_tool_calls_keeps_what_does_not_parse():
    content, calls = parse_tool_calls('ok <tool_call>{"name": "echo", "arguments": {"digit": "7"}}</tool_call>')
    assert content == "ok" and calls == [{"id": "call_0", "type": "function",
                                          "function": {"name": "echo", "arguments": '{"digit": "7"}'}}]
    assert parse_tool_calls("<tool_call>{name: echo}</tool_call>") == ("<tool_call>{name: echo}</tool_call>", [])


class StandInCore:
    """What ``OpenAIService`` calls to sample: one completion per request, the engine's tokens given."""

    def sample(self, prompts, n=1, listener=None, **kwargs):
        return SimpleNamespace(completions=[[Completion([12, 13, 2], [-1.0, -2.0, -0.5], "stop", weight_version=0)] * n])


@pytest.mark.parametrize("leaves", ["before it is recorded", "after it is recorded", "after the last chunk"])
def test_a_stream_whose_client_leaves_flags_its_segments_once_whenever_it_leaves(server, leaves):
    """``LiveStream``: the client leaving before the answer is recorded flags it as it is recorded, after that flags it
    at once, after the whole answer was sent not at all; a listener that has seen it leave wants the engine to stop."""
    from arctic_rl.rollout.openai.live import LiveStream

    service = OpenAIService(StandInCore(), server.tokenizer, "m", MAX_PROMPT, MAX_RESPONSE)
    request = service.prepare({"messages": [{"role": "user", "content": "echo 9"}], "stream": True}, "gone", True)
    loop = asyncio.new_event_loop()
    try:
        live = LiveStream(service, request, loop)
        if leaves == "before it is recorded":
            live.leave()
        live.run()
        if leaves == "after the last chunk":
            live.finished = True
        live.leave()
        live.leave()
    finally:
        loop.close()
    assert live.wants_stop() == (leaves != "after the last chunk")
    [segment] = service.store.get("gone").segments
    assert segment.response_ids == [12, 13, 2] and segment.loss_mask == [1, 1, 1] and segment.versions == [0, 0, 0]
    assert segment.client_disconnected == (leaves != "after the last chunk")


def test_siblings_of_a_later_turn_branch_from_the_sequence_before_it_grew():
    from arctic_rl.rollout.engines.base import Completion
    from arctic_rl.rollout.openai.episodes import EpisodeStore

    store = EpisodeStore()
    assert store.record("s", [1, 2], [Completion([7, 8], [-0.1, -0.2], "length", weight_version=0)]) == [0]
    same = Completion([9], [-0.3], "stop", weight_version=1)
    assert store.record("s", [1, 2, 7, 8, 4, 5], [same, same]) == [0, 1]  # equal siblings, two segments
    grown, sibling = store.get("s").segments
    for segment in (grown, sibling):
        assert segment.token_ids == [1, 2, 7, 8, 4, 5, 9] and segment.loss_mask == [1, 1, 0, 0, 1]
        assert segment.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3] and segment.versions == [0, 0, -1, -1, 1]
    assert grown.turns == sibling.turns == 2 and store.get("s").divergences == 0
    assert store.record("s", [1, 3], [same]) == [2] and store.get("s").divergences == 1 and store.divergences == 1
