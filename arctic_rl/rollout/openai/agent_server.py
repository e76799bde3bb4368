"""The endpoint ``fit``'s agent rollouts run against: the OpenAI routes (``routes.py``) on loopback, in a thread of the
training process, sampling with the run's engine.

- ``EngineSampler`` is the ``Sampler``: the requests of concurrent episodes wait in one queue, and a worker thread
  samples them in one ``engine.generate`` call per set of settings once every running episode has a request waiting,
  or when none has arrived for ``linger_s`` (an episode that is busy in its tools does not hold the others).
- ``Episodes`` admits each request (``OpenAIService.admit``): only the sessions of the running batch; ``n`` 1; the
  run's temperature and top-p; at most ``max_turns`` requests; the first prompt within
  ``sampling.max_prompt_length`` and everything after it within ``sampling.max_response_length`` (each request's
  ``max_tokens`` cut to what is left); turn ``t`` of sample ``k`` of a row sampled from
  ``mix_seed(sample_seed(row seed, k), t)``, as the multi-turn loop's.
- ``AgentServer`` is uvicorn on ``127.0.0.1`` (a free port) with a random bearer token, started once per process and
  closed with the rollout (``close_agent_server``).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from arctic_rl.errors import RequestError
from arctic_rl.rollout.engines.base import Completion, RolloutEngine, SamplingConfig
from arctic_rl.rollout.engines.seeds import mix_seed
from arctic_rl.rollout.openai.episodes import EpisodeStore
from arctic_rl.rollout.openai.fields import Sampling
from arctic_rl.rollout.openai.service import OpenAIService

log = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None
    stop_token_ids: tuple[int, ...]
    done: threading.Event = field(default_factory=threading.Event)
    completion: Completion | None = None
    error: BaseException | None = None


@dataclass
class _Output:
    completions: list[list[Completion]]


class EngineSampler:
    """Batches concurrent requests into ``engine.generate`` calls (see the module's docstring)."""

    def __init__(self, linger_s: float = 0.05):
        self.linger_s = linger_s
        self._cond = threading.Condition()
        self._pending: list[_Request] = []
        self._busy = False  # an engine call is running
        self._last_arrival = 0.0
        self._closed = False
        self.engine: RolloutEngine | None = None
        self.temperature, self.top_p = 1.0, 1.0
        self.live = 0  # episodes running now (``run_agents`` keeps it)
        self.failure: BaseException | None = None  # the engine's first error (the rollout re-raises it)
        self.calls = 0  # engine calls made
        self._worker = threading.Thread(target=self._serve, name="arctic-rl-agent-sampler", daemon=True)
        self._worker.start()

    def sample(self, prompts: list[list[int]], n: int = 1, max_tokens: int | None = None, temperature: float = 1.0,
               top_p: float = 1.0, seed: int | None = None, stop_token_ids: list[int] = (), listener=None) -> _Output:
        """One prompt's one completion (``Episodes.admit`` has set ``max_tokens``, the run's temperature and the seed).
        A streamed request is answered whole (``listener`` is never told: the batch's engine call serves many)."""
        request = _Request(list(prompts[0]), int(max_tokens), seed, tuple(stop_token_ids))
        with self._cond:
            if self._closed:
                raise RequestError("the rollout's endpoint is closing")
            self._pending.append(request)
            self._last_arrival = time.monotonic()
            self._cond.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return _Output([[request.completion]])

    def add_live(self, change: int) -> None:
        """An episode started (+1) or ended (-1): a full batch may be ready."""
        with self._cond:
            self.live += change
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._worker.join(timeout=60)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        for r in self._pending:
                            r.error = RequestError("the rollout's endpoint closed")
                            r.done.set()
                        return
                    if self._pending:
                        quiet = time.monotonic() - self._last_arrival
                        if len(self._pending) >= self.live or quiet >= self.linger_s:
                            break
                        self._cond.wait(self.linger_s - quiet)
                    else:
                        self._cond.wait()
                batch, self._pending, self._busy = self._pending, [], True
            try:
                self._generate(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _generate(self, batch: list[_Request]) -> None:
        groups: dict[tuple, list[_Request]] = {}
        for r in batch:
            groups.setdefault((r.max_tokens, r.stop_token_ids, r.seed is None), []).append(r)
        for (max_tokens, stop, unseeded), requests in groups.items():
            sampling = SamplingConfig(n=1, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                      prompt_seeds=None if unseeded else tuple(r.seed for r in requests),
                                      stop_token_ids=stop)
            try:
                outputs = self.engine.generate([r.prompt_ids for r in requests], sampling)
                self.calls += 1
            except BaseException as e:  # noqa: BLE001  (the engine's failure ends the rollout, not just these requests)
                self.failure = self.failure or e
                for r in requests:
                    r.error = e
                    r.done.set()
                continue
            for r, out in zip(requests, outputs):
                r.completion = out[0]
                r.done.set()


@dataclass
class _Session:
    seed: int | None
    first_prompt_length: int | None = None
    requests: int = 0
    budget_refused: bool = False
    last_cut_by_budget: bool = False  # the last request's max_tokens was what was left of the budget


class Episodes:
    """The running batch's sessions and the rules each request is admitted by (see the module's docstring)."""

    def __init__(self) -> None:
        self.max_prompt_length = self.max_response_length = self.max_turns = 0
        self.temperature, self.top_p = 1.0, 1.0
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    def open(self, sessions: dict[str, int | None], max_prompt_length: int, max_response_length: int, max_turns: int,
             temperature: float, top_p: float) -> None:
        """Start a batch's sessions (id -> the seed its turns' seeds are mixed from, or None: unseeded) under these rules."""
        with self._lock:
            self._sessions = {sid: _Session(seed) for sid, seed in sessions.items()}
            self.max_prompt_length, self.max_response_length, self.max_turns = max_prompt_length, max_response_length, max_turns
            self.temperature, self.top_p = temperature, top_p

    def close(self) -> dict[str, _Session]:
        """End the batch: later requests of its sessions are refused. Returns what each session did."""
        with self._lock:
            sessions, self._sessions = self._sessions, {}
            return sessions

    def admit(self, session_id: str, prompt_ids: list[int], sampling: Sampling, body: dict[str, Any]) -> Sampling:
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p)):
            if body.get(name) is not None and getattr(sampling, name) != value:
                raise RequestError(f"{name}={getattr(sampling, name)}: agent rollouts sample at the run's"
                                   f" model.sampling.{name}={value} (the trained policy); leave it unset")
        if sampling.n != 1:
            raise RequestError(f"n={sampling.n}: agent rollouts sample one completion per request; a row's group is its"
                               " model.sampling.group_size episodes")
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise RequestError(f"X-Session-Id {session_id!r}: not an episode of the running rollout batch (use the"
                                   " client the agent was given; its requests carry the episode's session)")
            if session.requests >= self.max_turns:
                raise RequestError(f"messages: the episode has made its model.rollout.agent.max_turns={self.max_turns}"
                                   " requests")
            if session.first_prompt_length is None:
                if len(prompt_ids) > self.max_prompt_length:
                    raise RequestError(f"messages: the first prompt is {len(prompt_ids)} tokens, over"
                                       f" model.sampling.max_prompt_length={self.max_prompt_length}")
                session.first_prompt_length = len(prompt_ids)
            left = self.max_response_length - (len(prompt_ids) - session.first_prompt_length)
            if left < 1:
                session.budget_refused = True
                raise RequestError(f"messages: the episode is {len(prompt_ids) - session.first_prompt_length} tokens past"
                                   f" its first prompt, its whole budget (model.sampling.max_response_length="
                                   f"{self.max_response_length})")
            turn = session.requests
            session.requests += 1
        max_tokens = left if sampling.max_tokens is None else min(sampling.max_tokens, left)
        session.last_cut_by_budget = max_tokens == left
        seed = None if session.seed is None else mix_seed(session.seed, turn)
        return dataclasses.replace(sampling, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, seed=seed)


class AgentServer:
    """The routes on loopback in a thread of this process, over ``EngineSampler`` and ``Episodes``."""

    def __init__(self, tokenizer, max_in_flight: int, model_name: str = "policy"):
        from fastapi import FastAPI

        from arctic_rl.rollout.openai.routes import add_completion_routes, bearer_token

        self.sampler, self.episodes, self.max_in_flight = EngineSampler(), Episodes(), max_in_flight
        self.service = OpenAIService(self.sampler, tokenizer, model_name, 0, 0, admit=self.episodes.admit)
        self.service.store = EpisodeStore(warn_each=False)  # divergences are reported per batch (``agents.agent_metrics``)
        self.token = secrets.token_urlsafe(24)
        app = FastAPI()
        add_completion_routes(app, self.service, dependencies=[bearer_token(self.token)])
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(max(128, max_in_flight))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        self._threads = max_in_flight + 8  # every episode's request may wait in a worker thread for its batch
        self._server = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(app, started), name="arctic-rl-agent-endpoint", daemon=True)
        self._thread.start()
        if not started.wait(60):
            raise RuntimeError("the agent rollouts' endpoint did not start within 60 s")

    def _run(self, app, started: threading.Event) -> None:
        import anyio.to_thread
        import uvicorn

        async def serve() -> None:
            anyio.to_thread.current_default_thread_limiter().total_tokens = self._threads
            self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
            task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
            while not self._server.started and not task.done():
                await asyncio.sleep(0.01)
            started.set()
            await task

        asyncio.run(serve())

    def close(self) -> None:
        self.sampler.close()
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()


_SERVER: dict[str, AgentServer] = {}  # one per process, started by the first agent rollout


def agent_server(tokenizer, max_in_flight: int) -> AgentServer:
    """The process's endpoint: started on first use, and again for another tokenizer or a larger ``max_in_flight``."""
    server = _SERVER.get("server")
    if server is not None and (server.sampler.failure is not None or server.service.tokenizer is not tokenizer or server.max_in_flight < max_in_flight):
        close_agent_server()
        server = None
    if server is None:
        server = _SERVER["server"] = AgentServer(tokenizer, max_in_flight)
        atexit.register(close_agent_server)
    return server


def close_agent_server() -> None:
    """Stop the process's endpoint, if one runs (the rollout callback's shutdown)."""
    server = _SERVER.pop("server", None)
    if server is not None:
        server.close()
