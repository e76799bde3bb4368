"""The environment arctic-rl gives vLLM, in one place; a value the user set always wins.

Light on purpose (no torch, no vLLM): the CLI applies it before anything heavy is imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

VLLM_ENV_DEFAULTS = {
    # the engine core runs in this process: ~10x faster start on CPU, and collective_rpc can pass tensors
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vLLM's log records go to the application's handlers (Lightning's, pytest's), not vLLM's own
    "VLLM_CONFIGURE_LOGGING": "0",
}


def vllm_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The defaults, with any value already set in ``environ`` kept (for a child's environment)."""
    return {key: environ.get(key, value) for key, value in VLLM_ENV_DEFAULTS.items()}


def apply_vllm_env_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set each default in ``environ`` where it is unset."""
    for key, value in VLLM_ENV_DEFAULTS.items():
        environ.setdefault(key, value)
