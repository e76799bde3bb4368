"""``ProcessRanks``: a job's training ranks as local processes (``training.launcher: processes``, the no-Ray default on
one machine): each an ``arctic-rl serve`` of ``worker.build_rank_handler`` on loopback with a fresh token, reached
over HTTP."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
from typing import Any

from arctic_rl.serve.errors import JobFailed
from arctic_rl.serve.ranks.placement import RANK_HANDLER, Ranks
from arctic_rl.serve.transport import Message

DEATH_WAIT_S = 1.0  # after a rank's call failed: how long its process gets to be seen exiting


def exit_text(code: int) -> str:
    """A process's exit status in words (negative: the signal that ended it)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class ProcessRanks(Ranks):
    """The ranks as ``ServerProcess`` es of this machine (``RANK = LOCAL_RANK``, ``NODE_RANK`` 0, ``MASTER_ADDR``
    loopback), each reached by an ``HttpTransport``."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._servers: list = []  # ServerProcess per rank
        self._transports: list = []  # HttpTransport per rank

    @property
    def pids(self) -> list[int]:
        return [server.pid for server in self._servers]

    @property
    def nodes(self) -> list[str]:
        return ["local"] * len(self._servers)

    def where(self, rank: int) -> str:
        return ""

    def start(self, rank_config: dict[str, Any]) -> None:
        from arctic_rl.serve.transports.http_client import HttpTransport
        from arctic_rl.serve.transports.process import start_server_process
        from arctic_rl.weight_sync.broadcast import free_port

        timeouts = self.config.timeouts
        common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(self.world_size),
                  "NODE_RANK": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                                      str(max(1, (os.cpu_count() or 1) // self.world_size)))}
        with concurrent.futures.ThreadPoolExecutor(self.world_size, thread_name_prefix="arctic-rl-rank-start") as pool:
            started = [pool.submit(start_server_process, rank_config, handler=RANK_HANDLER,
                                   startup_timeout_s=timeouts.startup_s,
                                   env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                       for rank in range(self.world_size)]
        self._servers = [future.result() for future in started if future.exception() is None]
        failed = [future.exception() for future in started if future.exception() is not None]
        if failed:
            raise JobFailed(f"a training rank did not start: {failed[0]}") from failed[0]
        self._transports = [HttpTransport(server.url, auth_token=server.token, connect_timeout_s=timeouts.connect_s,
                                          call_timeout_s=timeouts.call_s) for server in self._servers]

    def call(self, rank: int, op: str, request: Message, timeout_s: float) -> Message:
        return self._transports[rank].call(op, request, timeout_s)

    def dead(self, errors: dict[int, BaseException]) -> list[tuple[int, str]]:
        dead = []
        for r, server in enumerate(self._servers):
            try:
                code = server.process.wait(DEATH_WAIT_S) if r in errors else server.process.poll()
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                dead.append((r, exit_text(code)))
        return dead

    def stop(self, timeout_s: float) -> None:
        for server in self._servers:
            server.request_stop()
        for server in self._servers:
            server.stop(timeout_s)
        for transport in self._transports:
            transport.close()
