"""Runs many ``arctic-rl`` command lines, each in its own process, paying the imports once.

``python -m tests.cli_forks MANIFEST.json [PARALLEL [LIMIT_S]]``: the manifest lists ``{"argv": [...], "stdout": path,
"stderr": path, "cwd": dir}``; this process imports what every ``arctic-rl fit`` imports before it stops (torch,
Lightning, jsonargparse, wandb, transformers, the CLI's modules, vLLM's engine arguments), then forks one child per
command line, ``PARALLEL`` (2) at a time. Each child points its stdout and stderr at the given files and runs
``arctic_rl.cli.main()`` with that ``sys.argv`` exactly as the ``arctic-rl`` console script does, ending with main's
exit status (a traceback and 1 for an uncaught exception, as Python reports it); a child still running after
``LIMIT_S`` (180; a config-error case that trains instead of stopping at start) is killed (-9). Prints ``{index: exit status}`` as JSON.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time


PRELOAD = ("lightning.pytorch", "lightning.pytorch.cli", "transformers", "jsonargparse", "docstring_parser",
           "typeshed_client", "wandb", "arctic_rl.cli", "arctic_rl.console", "arctic_rl.cluster.launch",
           "arctic_rl.callbacks.atomic_checkpoints", "arctic_rl.callbacks.optimizer_follows_config",
           "arctic_rl.callbacks.preemption", "arctic_rl.callbacks.progress", "arctic_rl.callbacks.resume_state",
           "arctic_rl.callbacks.safety_net", "arctic_rl.data.prompts", "arctic_rl.modules.grpo", "arctic_rl.preflight",
           "arctic_rl.rollout.callback", "arctic_rl.tasks.toy")


def exit_status(end: SystemExit) -> int:
    """The status a process ending with ``end`` exits with, as the interpreter gives it (a message: printed, then 1)."""
    if not isinstance(end.code, (int, type(None))):
        print(end.code, file=sys.stderr)
    return end.code if isinstance(end.code, int) else 0 if end.code is None else 1


def run_child(case: dict) -> None:
    """In a forked child: run ``arctic-rl *argv`` and never return. The end is Python's for the console script
    (the exit status, a ``SystemExit`` message or a traceback on stderr, then the ``atexit`` handlers), without
    the interpreter's teardown of every module the parent imported (seconds of CPU for each child)."""
    os.chdir(case["cwd"])
    for fd, path in ((1, case["stdout"]), (2, case["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["arctic-rl", *case["argv"]]
    from arctic_rl.cli import main

    try:
        main()
        code = 0  # main returned: a normal end
    except SystemExit as end:
        code = exit_status(end)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(manifest: str, parallel: int = 2, limit_s: float = 180) -> None:
    import importlib

    from arctic_rl.rollout.engines.factory import accepted_engine_kwargs, resolved_kind

    for name in PRELOAD:  # what every `arctic-rl fit` imports before it stops; the children inherit it
        importlib.import_module(name)
    if resolved_kind("auto") == "vllm":  # vLLM's LLM and EngineArgs: preflight's engine_kwargs check reads them
        accepted_engine_kwargs("vllm")

    cases = json.loads(open(manifest).read())
    running: dict[int, tuple[int, float]] = {}  # pid -> (case index, start time)
    codes: dict[int, int] = {}
    pending = list(range(len(cases)))
    while pending or running:
        while pending and len(running) < parallel:
            index = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                run_child(cases[index])
            running[pid] = (index, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[running.pop(pid)[0]] = os.waitstatus_to_exitcode(status)
            continue
        for child, (_, started) in running.items():
            if time.monotonic() - started > limit_s:  # a case that does not stop at start (it trains): -9
                os.kill(child, signal.SIGKILL)
        time.sleep(0.1)
    print(json.dumps(codes))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]), *(float(a) for a in sys.argv[3:4]))
