"""A streamed request answered while the engine decodes it: the request is sampled in a worker thread with a
``DecodeListener`` that hands each decode step's tokens to the server's event loop, which sends them as chunks.

An engine that cannot stream (vLLM, Ray replicas, ranks in other processes: ``Operations.sample``) tells no steps; the
whole answer is then sent when it is sampled, as ``StreamChunks.end`` sends what no step told. Either way the episode
is recorded from the completions the engine returned, exactly.

A client that leaves mid-stream: the listener then ``wants_stop``, so an engine that streams ends the call at its next
decode step (every row keeps the tokens it has, finish reason ``length``); the completions are recorded as sampled, cut
there, and their segments flagged ``client_disconnected``. The engine runs one call at a time for the whole job, so
decoding on for nobody would only hold up the other requests. An engine that answers whole finishes the call; its
completions are recorded whole, flagged the same."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from arctic_rl.rollout.engines.base import DecodeStep
from arctic_rl.rollout.openai.chunks import StreamChunks
from arctic_rl.rollout.openai.service import CompletionRequest, OpenAIService, Sampled


class LiveStream:
    """One streamed request between the thread that samples it and the event loop that sends it.

    ``DecodeListener`` (called in the engine's thread): :meth:`on_step`, :meth:`wants_stop`. The worker thread runs
    :meth:`run`; the event loop reads :meth:`first`, then :meth:`chunks`, and calls :meth:`leave` when the client goes.
    """

    def __init__(self, service: OpenAIService, request: CompletionRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.service, self.request, self.loop = service, request, loop
        self.queue: asyncio.Queue[DecodeStep | Sampled | Exception] = asyncio.Queue()  # read on ``loop`` only
        self.sampled: Sampled | None = None  # once run and recorded
        self.finished = False  # every chunk was handed to the connection
        self._left = threading.Event()
        self._lock = threading.Lock()  # orders ``leave`` against ``run``'s recording: the flag is set exactly once

    # ------------------------------------------------------------------ the engine's thread
    def on_step(self, step: DecodeStep) -> None:
        self._put(step)

    def wants_stop(self) -> bool:
        return self._left.is_set()

    # ------------------------------------------------------------------ the worker thread
    def run(self) -> None:
        """Sample the request, record it (flagged if the client has left), then hand the answer (or the error) to the
        loop."""
        try:
            completions = self.service.complete(self.request, listener=self)
            with self._lock:  # recorded and flagged in one step: a reader never sees the one without the other
                self.sampled = self.service.record(self.request, completions, client_disconnected=self._left.is_set())
        except Exception as e:  # noqa: BLE001  (the client's answer: a JSON error, or an error event mid-stream)
            self._put(e)
            return
        self._put(self.sampled)

    def _put(self, item: DecodeStep | Sampled | Exception) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed (the server stopped): nobody reads on
            pass

    # ------------------------------------------------------------------ the event loop
    async def first(self) -> DecodeStep | Sampled | Exception:
        """The first decode step, or the whole answer (an engine that cannot stream), or the error that ended the call
        before any step (answered as a JSON error, since no chunk has been sent)."""
        return await self.queue.get()

    async def chunks(self, first: DecodeStep | Sampled) -> AsyncIterator[dict[str, Any]]:
        """The answer's chunks (``StreamChunks``) as the engine's steps come, from ``first`` (see :meth:`first`) to
        the end; an error that ends the call after the first step is raised here (the transport sends it as OpenAI's
        error object, the stream's last event)."""
        chunks = StreamChunks(self.service, self.request)
        for chunk in chunks.start():
            yield chunk
        item: DecodeStep | Sampled | Exception = first
        while isinstance(item, DecodeStep):
            for chunk in chunks.step(item):
                yield chunk
            item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        for chunk in chunks.end(item):
            yield chunk

    def leave(self) -> None:
        """The client left before the answer ended: stop the engine at its next step (one that streams), and flag the
        segments ``client_disconnected`` (now if they are recorded, else when they are). Idempotent."""
        if self.finished:
            return
        with self._lock:
            first_time, sampled = not self._left.is_set(), self.sampled
            self._left.set()
        if first_time and sampled is not None:
            self.service.store.mark_disconnected(sampled.session_id, sampled.segments)
