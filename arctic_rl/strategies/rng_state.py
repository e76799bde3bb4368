"""Every random stream of this process (Python, NumPy, torch, CUDA) as plain tensors and numbers, so that a
checkpoint's per-rank RNG file loads with ``torch.load(weights_only=True)``: nothing pickled is ever run."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = 2  # 1: Lightning's pickled states (a NumPy array inside); 2: this module's plain form


def collect() -> dict[str, Any]:
    """The current states: tensors, ints, floats, lists and None only."""
    version, python_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "format": FORMAT,
        "torch": torch.get_rng_state(),
        "torch.cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [version, list(python_state), gauss],
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
    }


def restore(states: dict[str, Any]) -> None:
    """Set every stream from :func:`collect`'s dict (CUDA only where both sides have it)."""
    torch.set_rng_state(states["torch"])
    if states["torch.cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch.cuda"])
    version, python_state, gauss = states["python"]
    random.setstate((version, tuple(python_state), gauss))
    n = states["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))


def save(path: str | Path) -> None:
    torch.save(collect(), path)


def load(path: str | Path) -> dict[str, Any]:
    """The states saved at ``path``, read with ``weights_only=True``.

    Raises:
        pickle.UnpicklingError: the file holds anything but plain data (a file of format 1, or one planted).
        ValueError: plain data, but not this module's format.
    """
    states = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(states, dict) or states.get("format") != FORMAT:
        raise ValueError(f"{Path(path).name}: not an RNG state of format {FORMAT}")
    return states
