"""Starts the ranks of multi-process test runs, paying a rank script's imports once per rank instead of once per run.

``python -m tests.rank_forks WORKER [MODULE ...]``: this process runs ``WORKER`` (one rank's script, e.g.
``tests/strategies/grpo_worker.py``) under a module name other than ``__main__``, which imports what it imports
(torch, Lightning, transformers, arctic_rl: seconds of CPU) and defines its functions without starting it, and
imports each ``MODULE`` (what a rank imports later, at its first use: DeepSpeed, the model's class). Then it
serves requests, one JSON line each on stdin: ``{"argv": [...], "env": {...}, "log": path}``. For each it forks a
child that appends its output to ``log``, adds ``env`` to its environment and runs ``WORKER`` as ``__main__`` with
``argv``, as ``python WORKER *argv`` does (an uncaught exception: its traceback on stderr and exit status 1); it
answers on stdout ``{"pid": ...}`` once the child is forked and ``{"code": ...}`` once it has ended (a negative
code: the signal that ended it), one JSON line each; what its imports print goes to stderr. It ends at the end of
its stdin.

The test side (``tests/strategies/conftest.py``, ``RankForks``) starts one of these per rank, so the ranks of one run
come from different processes, each with its own hash seed, as the ranks a launcher starts do.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import sys

from tests.cli_forks import exit_status


def run_rank(worker: str, request: dict, replies: int) -> None:
    """In a forked child: run ``worker`` as ``__main__`` and never return."""
    code = 1
    try:
        os.close(replies)  # the server's answers are not the rank's to write
        os.environ.update(request["env"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the requests are the server's, not the rank's
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log), os.close(devnull)
        sys.argv = [worker, *request["argv"]]
        runpy.run_path(worker, run_name="__main__")
        code = 0  # the script returned: a normal end
    except SystemExit as end:
        code = exit_status(end)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(worker: str, *modules: str) -> None:
    replies = os.fdopen(os.dup(1), "w")  # the answers' own channel: what the imports print goes to stderr
    os.dup2(2, 1)
    worker = os.path.abspath(worker)
    sys.path.insert(0, os.path.dirname(worker))  # as `python WORKER` puts the script's folder first
    runpy.run_path(worker, run_name="__rank_forks_preload__")  # its imports, not its main
    for name in modules:
        importlib.import_module(name)
    sys.stdout.flush(), sys.stderr.flush()  # nothing buffered for the children to write again
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_rank(worker, request, replies.fileno())
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
