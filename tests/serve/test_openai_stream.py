"""Streaming of the OpenAI-compatible endpoint as the engine decodes: a real ``ServiceCore`` (the tiny Qwen3, the
transformers engine) behind the OpenAI routes on a loopback uvicorn, in this process, so the test can order the engine
against its client: ``HoldingCore`` passes the service's ``DecodeListener`` on wrapped so that the decode loop waits
after a chosen step until the client has done something. With the real ``openai`` SDK, the first token reaches the
client while the engine call still runs, and the deltas add up to the non-streamed answer of the same seed; a raw
client that leaves mid-stream stops the engine there, and its episode is recorded cut, flagged ``client_disconnected``.
Also the chunks' text alone, over a byte-level tokenizer that splits characters between tokens."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

openai = pytest.importorskip("openai")

from arctic_rl.rollout.engines.base import Completion, DecodeStep  # noqa: E402
from arctic_rl.rollout.openai.chunks import StreamChunks  # noqa: E402
from arctic_rl.rollout.openai.fields import Sampling  # noqa: E402
from arctic_rl.rollout.openai.service import CompletionRequest, OpenAIService, Sampled  # noqa: E402

TOKEN, MAX_PROMPT, MAX_RESPONSE = "stream-test", 48, 10
GUARD_S = 120.0  # only a hang guard: a hold that waits this long is a failure


class HoldingCore:
    """A test instrument around the real core: the ``listener`` its ``sample`` passes on tells the service's listener
    each step, counts the steps, and after step ``hold_at`` waits until ``until(listener)`` is true (then
    ``held_out`` says whether it had to give up). ``returned`` is set when the core's call has returned.
    ``withhold``: pass no listener, as a core whose engine cannot stream. ``fail_at``: raise at that step, as a call
    that fails once the stream has begun (a fault the test injects)."""

    def __init__(self, core) -> None:
        self.core, self.config = core, core.config
        self.hold_at, self.until, self.withhold, self.fail_at = None, None, False, None
        self.steps, self.held_out, self.returned = 0, False, threading.Event()

    def sample(self, prompts, listener=None, **kwargs):
        self.steps, self.held_out = 0, False
        self.returned.clear()
        try:
            held = None if listener is None or self.withhold else _Held(self, listener)
            return self.core.sample(prompts, listener=held, **kwargs)
        finally:
            self.returned.set()


class _Held:
    def __init__(self, holder: HoldingCore, inner) -> None:
        self.holder, self.inner = holder, inner

    def on_step(self, step) -> None:
        holder = self.holder
        holder.steps += 1  # before the step is handed on: the client may read its chunk before this thread runs again
        self.inner.on_step(step)
        if holder.steps == holder.fail_at:
            raise RuntimeError(f"the engine call failed at step {holder.steps} (injected by the test)")
        if holder.steps == holder.hold_at:
            deadline = time.monotonic() + GUARD_S
            while not holder.until(self.inner):
                if time.monotonic() > deadline:
                    holder.held_out = True
                    return
                time.sleep(0.005)

    def wants_stop(self) -> bool:
        return self.inner.wants_stop()


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    from arctic_rl.serve.config import ArcticRLClientConfig
    from arctic_rl.serve.core import ServiceCore
    from arctic_rl.serve.openai.app import add_openai_routes
    from arctic_rl.serve.ops import CoreHandler
    from arctic_rl.serve.transports.http_app import create_app
    from tests.helpers import app_on_loopback
    from tests.serve.conftest import client_config

    config = client_config(tiny_model_dir, tmp_path_factory.mktemp("openai-stream"), engines={"engine": "transformers"},
                           sampling={"max_prompt_length": MAX_PROMPT, "max_response_length": MAX_RESPONSE})
    core = ServiceCore(ArcticRLClientConfig.load(config))
    holding = HoldingCore(core)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    service = OpenAIService(holding, tokenizer, "m", MAX_PROMPT, MAX_RESPONSE)
    app = add_openai_routes(create_app(CoreHandler(core), auth_token=TOKEN, max_request_bytes=1 << 20, call_timeout_s=None),
                            service,
                            auth_token=TOKEN, max_request_bytes=1 << 20)
    with app_on_loopback(app) as url:
        yield SimpleNamespace(url=url, core=holding, service=service, tokenizer=tokenizer,
                              sdk=openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0))
    core.close()


def episode(served, session: str) -> dict:
    reply = httpx.get(f"{served.url}/v1/episodes/{session}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


ASKED = dict(model="m", messages=[{"role": "user", "content": "say 3 echo"}], n=2, max_tokens=MAX_RESPONSE, seed=5,
             logprobs=True)


def streamed(served, user: str, on_token=lambda: None) -> tuple[list[str], list[list[int]], list[str]]:
    """The SDK's stream of ``ASKED``: per choice its text, its token ids (from the log-probs) and finish reason;
    ``on_token`` runs when a chunk carrying a token comes."""
    texts, tokens, reasons = ["", ""], [[], []], ["", ""]
    for chunk in served.sdk.chat.completions.create(**ASKED, stream=True, user=user):
        for choice in chunk.choices:
            if choice.logprobs:
                on_token()
                tokens[choice.index] += served.tokenizer.convert_tokens_to_ids([t.token for t in choice.logprobs.content])
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, tokens, reasons


def test_a_stream_reaches_the_client_while_the_engine_decodes_and_adds_up_to_the_whole_answer(served):
    whole = served.sdk.chat.completions.create(**ASKED, user="whole")
    whole_tokens = [served.tokenizer.convert_tokens_to_ids([t.token for t in c.logprobs.content]) for c in whole.choices]
    assert min(map(len, whole_tokens)) > 2  # (the seed's samples outlast the hold below)
    first_token = threading.Event()
    seen = []  # at the first token chunk: (the engine call still running, steps it had told)

    def on_token() -> None:
        if not first_token.is_set():
            seen.append((not served.core.returned.is_set(), served.core.steps))
            first_token.set()

    served.core.hold_at, served.core.until = 2, lambda listener: first_token.is_set()  # after its 2nd step, the engine
    texts, tokens, reasons = streamed(served, "live", on_token)  # waits until the client has its first token
    assert not served.core.held_out and seen[0][0] and seen[0][1] in (1, 2), seen  # sent as decoded, not after
    assert texts == [c.message.content for c in whole.choices] and tokens == whole_tokens
    assert reasons == [c.finish_reason for c in whole.choices]
    recorded = episode(served, "live")["segments"]
    assert [s["response_ids"] for s in recorded] == tokens and not any(s["client_disconnected"] for s in recorded)
    assert [s["versions"] for s in recorded] == [[0] * len(t) for t in tokens]
    assert [s["logprobs"] for s in recorded] == [[t.logprob for t in c.logprobs.content] for c in whole.choices]

    served.core.hold_at, served.core.withhold = None, True  # a core whose engine cannot stream: sent whole at the end
    try:
        texts, tokens, reasons = streamed(served, "whole-then-sent")
    finally:
        served.core.withhold = False
    assert served.core.steps == 0 and texts == [c.message.content for c in whole.choices] and tokens == whole_tokens
    assert reasons == [c.finish_reason for c in whole.choices]


def test_a_client_that_leaves_mid_stream_stops_the_engine_and_its_episode_is_recorded_cut_and_flagged(served):
    whole = served.sdk.chat.completions.create(**ASKED, user="leaver-whole")
    full = [s for s in episode(served, "leaver-whole")["segments"]]
    assert min(len(s["response_ids"]) for s in full) > 3  # (the seed's samples outlast the cut below)
    # after its 3rd step the engine waits until the server has seen the client leave (its listener then wants_stop);
    # the client leaves once it has the 3 steps' tokens (2 choices each)
    served.core.hold_at, served.core.until = 3, lambda listener: listener.wants_stop()
    body = {**ASKED, "stream": True, "user": "leaver"}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as reply:
        assert reply.status_code == 200
        token_chunks = 0
        for line in reply.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0].get("logprobs"):
                token_chunks += 1
                if token_chunks == 3 * 2:
                    break  # leave: the stream is closed with the connection
    deadline = time.monotonic() + GUARD_S
    while httpx.get(f"{served.url}/v1/episodes/leaver", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404:
        assert time.monotonic() < deadline, "the episode of the client that left was never recorded"
        time.sleep(0.02)
    assert not served.core.held_out and served.core.steps == 3  # the engine stopped at the step after the client left
    cut = episode(served, "leaver")["segments"]
    assert [s["response_ids"] for s in cut] == [s["response_ids"][:3] for s in full]  # what was sampled, exactly
    assert [s["logprobs"] for s in cut] == [s["logprobs"][:3] for s in full]
    assert [s["versions"] for s in cut] == [[0, 0, 0]] * 2
    assert [(s["client_disconnected"], s["finish_reason"]) for s in cut] == [(True, "length")] * 2
    # the server goes on; the next session is its own, unflagged, and the one that left keeps its two segments
    served.core.hold_at = None
    after = served.sdk.chat.completions.create(**ASKED, user="after-leaver")
    [a, b] = episode(served, "after-leaver")["segments"]
    assert not a["client_disconnected"] and not b["client_disconnected"] and a["response_ids"] == full[0]["response_ids"]
    assert [c.message.content for c in after.choices] == [c.message.content for c in whole.choices]
    assert len(episode(served, "leaver")["segments"]) == 2 and episode(served, "leaver")["divergences"] == 0


def test_a_streamed_text_completion_adds_up_to_the_whole_one(served):
    asked = dict(model="m", prompt="echo 7 say", max_tokens=MAX_RESPONSE, seed=8, n=2)
    whole = served.sdk.completions.create(**asked, user="text-whole")
    texts, reasons = ["", ""], ["", ""]
    for chunk in served.sdk.completions.create(**asked, stream=True, user="text-streamed"):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert served.core.steps > 0 and texts == [c.text for c in whole.choices] and reasons == [c.finish_reason for c in whole.choices]
    streamed, recorded = episode(served, "text-streamed")["segments"], episode(served, "text-whole")["segments"]
    assert [s["response_ids"] for s in streamed] == [s["response_ids"] for s in recorded]


def test_a_call_that_fails_mid_stream_ends_it_with_the_error_and_records_nothing(served):
    served.core.fail_at = 2
    try:
        chunks = []
        with pytest.raises(openai.APIError, match="the engine call failed at step 2") as failed:
            for chunk in served.sdk.chat.completions.create(**ASKED, stream=True, user="failed"):
                chunks.append(chunk)
    finally:
        served.core.fail_at = None
    assert failed.value.body["type"] == "server_error" and any(c.choices and c.choices[0].logprobs for c in chunks)
    assert httpx.get(f"{served.url}/v1/episodes/failed", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404
    texts, tokens, _ = streamed(served, "after-failed")  # the job serves on
    assert all(tokens) and served.core.steps > 0


def byte_tokenizer():
    """A byte-level BPE without merges (one token per byte: a character of several bytes is split between tokens) and
    two more tokens: ``<|end|>`` (special) and ``STOP`` (a plain word a request's ``stop`` may name)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>")
    tokenizer.add_tokens(["STOP"])
    return tokenizer


@pytest.mark.parametrize("last", ["STOP", "<|end|>"])
def test_streamed_text_holds_back_split_characters_and_adds_up_to_the_whole_text(last):
    tokenizer = byte_tokenizer()
    text = "héllo ,  日本 !\n ok"
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(last)]
    stop = (tokenizer.convert_tokens_to_ids("STOP"),)
    service = OpenAIService(None, tokenizer, "m", 64, 64)  # no core: the tokens are given
    request = CompletionRequest("s", [5], Sampling(1, None, 1.0, 1.0, None, stop, True, True, False), True, "m", 0, "chatcmpl-x")
    chunks = StreamChunks(service, request)
    sent = chunks.start() + [c for t in ids[:-3] for c in chunks.step(DecodeStep([[t]], [[-0.5]]))]
    sampled = Sampled("s", [5], [Completion(ids, [-0.5] * len(ids), "stop")], [0], request.sampling, True, "m", 0, "chatcmpl-x")
    sent += chunks.end(sampled)  # the last 3 tokens as an engine that answers whole would leave them
    pieces = [c["choices"][0]["delta"].get("content") for c in sent]
    assert sent[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and sent[-1]["choices"][0]["finish_reason"] == "stop"
    assert "".join(p for p in pieces if p) == text == service.text(sampled.completions[0], request.sampling)
    assert not any("\ufffd" in p for p in pieces if p)  # no half character was ever sent
    told = [tokenizer.convert_tokens_to_ids(c["choices"][0]["logprobs"]["content"][0]["token"]) for c in sent
            if c["choices"][0].get("logprobs")]
    assert told == ids  # one chunk per token, its log-prob with it


def streamed_chat(text: str) -> tuple[list[dict], dict]:
    """``text`` then the end token, streamed token by token through ``StreamChunks``: the chunks, and the non-streamed
    choice of the same tokens."""
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|end|>")]
    service = OpenAIService(None, tokenizer, "m", 64, 256)  # no core: the tokens are given
    request = CompletionRequest("s", [5], Sampling(1, None, 1.0, 1.0, None, (ids[-1],), False, True, False), True, "m", 0, "chatcmpl-x")
    chunks = StreamChunks(service, request)
    sent = chunks.start() + [c for t in ids for c in chunks.step(DecodeStep([[t]], [[-0.5]]))]
    sampled = Sampled("s", [5], [Completion(ids, [-0.5] * len(ids), "stop")], [0], request.sampling, True, "m", 0, "chatcmpl-x")
    return sent + chunks.end(sampled), service.choice(sampled, 0)


@pytest.mark.parametrize("before", ["", "Let me look it up."])
def test_a_streamed_tool_call_arrives_as_tool_call_deltas_adding_up_to_the_whole_message(before):
    call = '<tool_call>{"name": "lookup", "arguments": {"q": "a<b"}}</tool_call>'
    sent, whole = streamed_chat(f"{before}\n{call}")
    deltas = [c["choices"][0]["delta"] for c in sent if "delta" in c["choices"][0]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert "<" not in content and content == before == (whole["message"]["content"] or "")  # no markup ever sent as text
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls == [{"index": 0, **c} for c in whole["message"]["tool_calls"]]
    assert calls[0]["function"] == {"name": "lookup", "arguments": '{"q": "a<b"}'} and calls[0]["id"] and calls[0]["type"] == "function"
    assert sent[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("text", ["x <tool_call>{not json}</tool_call>", "a < b and <tool_ca", "<tool"])
def test_text_that_is_no_tool_call_is_streamed_as_the_content_it_is(text):
    sent, whole = streamed_chat(text)
    deltas = [c["choices"][0]["delta"] for c in sent if "delta" in c["choices"][0]]
    assert "".join(d.get("content") or "" for d in deltas) == text == whole["message"]["content"]
    assert not any("tool_calls" in d for d in deltas) and sent[-1]["choices"][0]["finish_reason"] == "stop"
