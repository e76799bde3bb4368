"""The one place that changes DeepSpeed's objects at run time (written against deepspeed 0.19.8); if an upgrade breaks
a function here, it breaks here."""

from __future__ import annotations


def _no_shm_op() -> None:
    """DeepSpeed's own answer for an op it cannot build on this machine: no op, and its collectives use torch's."""
    return None


def skip_shm_comm_op() -> None:
    """Start CPU ranks without DeepSpeed's ``shm_comm`` op.

    On its first ``init_distributed`` on CPU, DeepSpeed JIT-compiles that C++ op (``deepspeed.comm.torch.build_shm_op``:
    about 50 s on 2 cores, a compiler needed, a build lock that a killed build leaves behind) and loads it into every
    rank. Its only user is ``inference_all_reduce``, which training never calls. This replaces the builder with one
    that returns None, as DeepSpeed's does where the op cannot be built; every collective then goes through
    torch.distributed (gloo), as it does for training anyway. Pinned by
    ``tests/strategies/test_shm_op.py::test_cpu_process_group_starts_without_the_shm_op``."""
    import importlib

    # by module name: ``import deepspeed.comm.torch`` would bind ``deepspeed.comm``'s attribute ``torch``, the torch package
    importlib.import_module("deepspeed.comm.torch").build_shm_op = _no_shm_op
