"""What ``arctic-rl`` shows on the terminal: the run's own output and the warnings a user can act on.
Library messages that are not the user's to act on (listed in :data:`KNOWN_NOISE`, each with the reason)
go only to the run's log file, ``<log dir>/arctic-rl.log``, which receives every message.

Python warnings are routed through ``logging`` (as ``logging.captureWarnings`` does), so one filter
covers both. Records made before the log directory is known (at Trainer construction) are held in memory
and written to the file once it is attached.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# imported before route_console() adds root handlers: Lightning then gives its loggers their own console
# handlers (with propagation off), as it does without us
import lightning.pytorch as pl
from typing_extensions import override

LOG_FILE_NAME = "arctic-rl.log"


@dataclass(frozen=True)
class Noise:
    """Records of ``logger`` (or its children) below ``below`` whose message contains ``text``; for
    Python warnings (logger ``py.warnings``) optionally only ``categories`` raised inside installed
    packages. ``why`` they are not the user's to act on."""

    logger: str
    text: str
    why: str
    below: int = logging.CRITICAL + 1
    categories: tuple[str, ...] = ()


DEPRECATIONS = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning", "LightningDeprecationWarning")

KNOWN_NOISE = (
    Noise("vllm", "", "vLLM's notices about the engine arctic-rl configured: LD_PRELOAD speed hints, thread"
          " binding, eager mode, seeding (its errors still show)", below=logging.ERROR),
    Noise("py.warnings", "Using ModelCheckpoint with manual optimization", "GRPOModule optimizes manually by design;"
          " a checkpoint holds the weights after the step's updates, which is what resume needs"),
    Noise("lightning.pytorch", "Tip: For seamless cloud logging", "an advertisement for litlogger"),
    Noise("py.warnings", "LightningCLI's args parameter is intended", "arctic-rl passes its own command line on (Ray workers)"),
    Noise("py.warnings", "", "a library's deprecation notice about its own code or another library's",
          categories=DEPRECATIONS),
)


def is_noise(record: logging.LogRecord) -> bool:
    """Whether ``record`` matches a :data:`KNOWN_NOISE` entry (then the console does not show it)."""
    name, message = record.name, record.getMessage()
    category, source = record.__dict__.get("category"), record.__dict__.get("source", "")
    for n in KNOWN_NOISE:
        if not (name == n.logger or name.startswith(n.logger + ".")) or record.levelno >= n.below or n.text not in message:
            continue
        if not n.categories or (category in n.categories and _installed(source)):
            return True
    return False


def _installed(path: str) -> bool:
    return "site-packages" in path or "dist-packages" in path


class NoiseFilter(logging.Filter):
    """Drops :data:`KNOWN_NOISE` records (on a console handler). A record it cannot read (a library's
    arguments that do not fit its format, e.g. ``%d`` given None) passes unchanged: the handler reports it
    as ``logging`` does (``--- Logging error ---``), and the run goes on. A filter never stops the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not is_noise(record)
        except Exception:  # noqa: BLE001  (anything a record's own getMessage() raises)
            return True


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` as ``logging.captureWarnings`` makes it, plus the category and source
    file on the record (for :data:`KNOWN_NOISE`)."""
    text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
    logging.getLogger("py.warnings").warning("%s", text, extra={"category": category.__name__, "source": filename})


_LOGGERS = ("", "lightning.pytorch", "lightning.fabric")  # Lightning's own handlers when it was imported first


class _Routing:
    """The handlers :func:`route_console` installed, so that they can be removed again."""

    def __init__(self) -> None:
        self.buffer = logging.handlers.MemoryHandler(capacity=100_000, flushLevel=logging.CRITICAL + 1)
        self.file: logging.FileHandler | None = None
        self.filtered: list[logging.Handler] = []
        self.added: list[tuple[logging.Logger, logging.Handler]] = []


_routing: _Routing | None = None


@contextlib.contextmanager
def route_console() -> Iterator[None]:
    """For the CLI's lifetime: known noise off the console, everything into the log file (once attached)."""
    global _routing
    routing = _routing = _Routing()
    root = logging.getLogger()
    if not root.handlers:  # what Python's last-resort handler did: warnings and errors, as they are, on stderr
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        root.addHandler(console)
        routing.added.append((root, console))
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if name and logger.propagate:
            continue  # reaches the root's handlers
        for handler in [h for h in logger.handlers if isinstance(h, logging.StreamHandler)]:
            handler.addFilter(NoiseFilter())
            routing.filtered.append(handler)
        logger.addHandler(routing.buffer)
        routing.added.append((logger, routing.buffer))
    show_warning, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        yield
    finally:
        warnings.showwarning = show_warning
        for logger, handler in routing.added:
            logger.removeHandler(handler)
            if handler is routing.buffer and routing.file is not None:
                logger.removeHandler(routing.file)
        for handler in routing.filtered:
            handler.filters = [f for f in handler.filters if not isinstance(f, NoiseFilter)]
        if routing.file is not None:
            routing.file.close()
        _routing = None


def attach_log_file(path: Path) -> Path | None:
    """Send every record (those held so far first) to ``path``; None when not running under the CLI."""
    routing = _routing
    if routing is None or routing.file is not None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    routing.file = logging.FileHandler(path)
    routing.file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    routing.buffer.setTarget(routing.file)
    routing.buffer.flush()
    for logger, handler in routing.added:
        if handler is routing.buffer:
            logger.removeHandler(routing.buffer)
            logger.addHandler(routing.file)
    return path


class RunLogFile(pl.Callback):
    """Attaches ``<run log dir>/arctic-rl.log`` on rank 0 once the logger has made its directory (at
    ``on_fit_start``, so that Lightning does not find a file in a directory it expects empty)."""

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from arctic_rl.callbacks.summary import run_log_dir

        if trainer.is_global_zero:
            attach_log_file(run_log_dir(trainer) / LOG_FILE_NAME)
