"""In-flight weight updates: new weights enter an engine between two steps of a decode loop that is running in
another thread, without dropping the requests in flight.

:class:`PauseGate` is the whole protocol between the two threads:

- the decoding thread wraps a call in :meth:`PauseGate.decoding` and calls :meth:`PauseGate.checkpoint` between
  decode steps; ``checkpoint`` returns the version of the weights the next step samples with;
- the updating thread loads the weights inside :meth:`PauseGate.paused`. That waits until the decode loop is at a
  checkpoint (or no call is running), so no step reads a half-written weight. The updating thread loads them itself,
  so a lazy iterator of tensors (a ZeRO-3 gather, a broadcast) is consumed where it was made. When the load is done,
  the version goes up by one and the loop resumes.

On CUDA the decoding thread finishes its queued work before it pauses, and the updating thread finishes its copies
before the loop resumes (``device_sync``), so the two threads' CUDA streams never overlap on the weights.

The KV cache the loop holds is kept across an update: tokens sampled after it attend over keys and values that the
older weights computed (as PipelineRL and NeMo-RL's in-flight updates do). Each token's version says which weights
sampled it, and its recorded log-prob is what that step computed, which is what the trainer's corrections use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class PauseGate:
    """Pauses a decode loop between steps while another thread loads weights (see the module docstring).

    Args:
        device_sync: waits for the calling thread's queued device work (``torch.cuda.current_stream().synchronize``
            on CUDA; nothing on a CPU).
        pause_timeout_s: the longest :meth:`paused` waits for the loop to reach a checkpoint before it raises.
    """

    def __init__(self, device_sync: Callable[[], None] = lambda: None, pause_timeout_s: float = 600.0) -> None:
        self._cv = threading.Condition()
        self._device_sync, self._pause_timeout_s = device_sync, pause_timeout_s
        self._decoding = False  # a call is inside ``decoding``
        self._wanted = False  # an update waits for (or holds) the pause
        self._paused = False  # the decode loop waits at a checkpoint
        self.version = 0  # weight updates loaded so far (0: the engine's start-up weights)
        self.deadline: float | None = None  # ``time.monotonic()`` at which a decode loop ends early (``StopsAtDeadline``)

    def expired(self) -> bool:
        """The decode loop should end at this step boundary (its deadline has passed)."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    @property
    def wanted(self) -> bool:
        """An update is waiting for the loop to pause (read between steps, without the lock)."""
        return self._wanted

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Around one generate call (an update being loaded now finishes first)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._wanted)
            self._decoding = True
        try:
            yield
        finally:
            with self._cv:
                self._decoding = False
                self._cv.notify_all()

    def checkpoint(self) -> int:
        """Between two decode steps: wait out an update if one is wanted; the version the next step samples with."""
        if self._wanted:
            self._device_sync()  # the steps queued so far have read the old weights before they are overwritten
            with self._cv:
                self._paused = True
                self._cv.notify_all()
                self._cv.wait_for(lambda: not self._wanted)
                self._paused = False
        return self.version

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the decode loop (if one runs) at its next checkpoint while the body loads weights; the version goes up
        by one when the body returns (not when it raises: those weights are not whole)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._wanted)  # one update at a time
            self._wanted = True
            if not self._cv.wait_for(lambda: not self._decoding or self._paused, timeout=self._pause_timeout_s):
                self._wanted = False
                self._cv.notify_all()
                raise TimeoutError(f"the decode loop did not reach a step boundary within {self._pause_timeout_s:g} s")
        loaded = False
        try:
            yield
            self._device_sync()  # the copies are done before the loop reads the weights again
            loaded = True
        finally:
            with self._cv:
                if loaded:
                    self.version += 1
                self._wanted = False
                self._cv.notify_all()
