"""Runs many ``arctic-rl`` command lines, each in its own process, paying the imports once.

``python -m tests.cli_forks MANIFEST.json``: the manifest lists ``{"argv": [...], "stdout": path,
"stderr": path, "cwd": dir}``; this process imports what every ``arctic-rl fit`` imports (torch, Lightning,
transformers, the CLI's modules), then forks one child per command line, two at a time. Each child
points its stdout and stderr at the given files and runs ``arctic_rl.cli.main()`` with that ``sys.argv``
exactly as the ``arctic-rl`` console script does, ending with main's exit status (a traceback and 1
for an uncaught exception, as Python reports it); a child still running after ``limit_s`` (one that
trains instead of stopping at start) is killed (-9). Prints ``{index: exit status}`` as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def run_child(case: dict) -> None:
    """In a forked child: run ``arctic-rl *argv`` and never return."""
    os.chdir(case["cwd"])
    for fd, path in ((1, case["stdout"]), (2, case["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["arctic-rl", *case["argv"]]
    from arctic_rl.cli import main

    main()
    sys.exit(0)  # main returned: a normal end (Python's shutdown runs atexit, as after the console script)


def main(manifest: str, parallel: int = 2, limit_s: float = 180) -> None:
    import lightning.pytorch  # noqa: F401  (what every `arctic-rl fit` imports; the children inherit it)
    import transformers  # noqa: F401

    import arctic_rl.cli  # noqa: F401
    import arctic_rl.data.prompts  # noqa: F401
    import arctic_rl.modules.grpo  # noqa: F401
    import arctic_rl.preflight  # noqa: F401
    import arctic_rl.rollout.callback  # noqa: F401
    import arctic_rl.tasks.toy  # noqa: F401

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
    main(sys.argv[1])
