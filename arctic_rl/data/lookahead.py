"""``LookaheadIterator``: an iterator over batches that can show the next batch before it is taken.

Overlapped rollouts (``RolloutCallback(max_staleness >= 1)``) generate batch t+1 while the trainer
updates on batch t; Lightning hands a batch over only when its step starts, so the loader's iterator
is wrapped in this, and the rollout callback peeks at the batch Lightning will hand over next. The
order of batches is the wrapped iterator's, untouched: a peeked batch is buffered and returned by the
next ``next()``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any


class LookaheadIterator(Iterator):
    """Wraps ``iterator``; :meth:`peek` fetches upcoming items early and keeps them for ``next()``."""

    def __init__(self, iterator: Iterator) -> None:
        self._iterator, self._buffered, self._exhausted = iterator, deque(), False

    def __next__(self) -> Any:
        if self._buffered:
            return self._buffered.popleft()
        if self._exhausted:
            raise StopIteration
        return next(self._iterator)

    def peek(self, ahead: int = 1) -> Any | None:
        """The item the ``ahead``-th ``next()`` from now returns (1: the next one), or None when the iterator ends
        before it."""
        if ahead < 1:
            raise ValueError(f"peek(ahead) takes ahead >= 1, got {ahead}")
        while len(self._buffered) < ahead and not self._exhausted:
            try:
                self._buffered.append(next(self._iterator))
            except StopIteration:
                self._exhausted = True
        return self._buffered[ahead - 1] if len(self._buffered) >= ahead else None
