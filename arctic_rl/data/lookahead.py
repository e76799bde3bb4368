"""``LookaheadIterator``: an iterator over batches that can show the next batch before it is taken.

Overlapped rollouts (``RolloutCallback(max_staleness >= 1)``) generate batch t+1 while the trainer
updates on batch t; Lightning hands a batch over only when its step starts, so the loader's iterator
is wrapped in this, and the rollout callback peeks at the batch Lightning will hand over next. The
order of batches is the wrapped iterator's, untouched: a peeked batch is buffered and returned by the
next ``next()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

_EMPTY = object()


class LookaheadIterator(Iterator):
    """Wraps ``iterator``; :meth:`peek` fetches the next item early and keeps it for ``next()``."""

    def __init__(self, iterator: Iterator) -> None:
        self._iterator, self._buffered, self._exhausted = iterator, _EMPTY, False

    def __next__(self) -> Any:
        if self._buffered is not _EMPTY:
            item, self._buffered = self._buffered, _EMPTY
            return item
        if self._exhausted:
            raise StopIteration
        return next(self._iterator)

    def peek(self) -> Any | None:
        """The item the next ``next()`` returns, or None when the iterator is exhausted."""
        if self._buffered is _EMPTY and not self._exhausted:
            try:
                self._buffered = next(self._iterator)
            except StopIteration:
                self._exhausted = True
        return None if self._buffered is _EMPTY else self._buffered
