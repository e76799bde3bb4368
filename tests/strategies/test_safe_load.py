"""Checkpoint files read without running pickled code: the RNG state as plain data, ``check_loadable``."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from arctic_rl.strategies import rng_state
from arctic_rl.strategies.safe_load import check_loadable


def test_the_rng_state_round_trips_through_weights_only(tmp_path):
    path = tmp_path / "rng.pt"
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    rng_state.save(path)
    want = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    rng_state.restore(rng_state.load(path))  # torch.load(weights_only=True) inside
    assert (random.random(), np.random.rand(), torch.rand(1)) == want


class Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_planted_pickle_is_refused_and_not_run(tmp_path):
    folder = tmp_path / "state"
    (folder / "checkpoint").mkdir(parents=True)
    torch.save({"weights": torch.ones(2)}, folder / "checkpoint" / "model.pt")
    torch.save({"torch": Planted(tmp_path / "ran")}, folder / "rng_state_rank0.pt")
    with pytest.raises(pickle.UnpicklingError, match=r"^rng_state_rank0.pt is not plain data"):
        check_loadable(folder)
    with pytest.raises(pickle.UnpicklingError):
        rng_state.load(folder / "rng_state_rank0.pt")
    assert not (tmp_path / "ran").exists()
    (folder / "rng_state_rank0.pt").unlink()
    check_loadable(folder)
