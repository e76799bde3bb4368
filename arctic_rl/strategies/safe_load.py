"""Reading checkpoints without running pickled code: ``torch.load(weights_only=True)``, which rebuilds only
tensors, plain containers and numbers, plus the few DeepSpeed classes its ZeRO optimizer states hold.

``WeightsOnlyCheckpointEngine`` is DeepSpeed's own ``TorchCheckpointEngine`` with this ``load`` (DeepSpeed
0.19's loads with ``weights_only=False``); ``check_loadable`` reads every torch file of a checkpoint this way
before anything is restored, so a file that is not plain data is refused with the model untouched."""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from typing_extensions import override


def deepspeed_safe_globals() -> list[Any]:
    """The classes a ZeRO-1/2 optimizer state file holds besides plain data (DeepSpeed 0.19): its loss
    scaler (two numbers), the ZeRO stage enum and the parameter slice addresses (a dataclass of ints)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def load_weights_only(path: str | Path, map_location: Any = None, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` with :func:`deepspeed_safe_globals` allowed.

    Raises:
        pickle.UnpicklingError: the file holds anything else (code would have run to rebuild it).
    """
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and zipfile.is_zipfile(path))


class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading with :func:`load_weights_only`."""

    @override
    def load(self, path: str, map_location=None):
        return load_weights_only(path, map_location=map_location)


def torch_files(checkpoint: str | Path) -> Iterator[Path]:
    """The torch files of a checkpoint: the file itself, or every ``*.pt`` / ``*.ckpt`` under its folder."""
    checkpoint = Path(checkpoint).resolve()
    if checkpoint.is_file():
        yield checkpoint
        return
    for path in sorted(checkpoint.rglob("*")):
        if path.suffix in (".pt", ".ckpt") and path.is_file():
            yield path


def check_loadable(checkpoint: str | Path) -> None:
    """Read every torch file of ``checkpoint`` with :func:`load_weights_only` (memory-mapped: tensors are not
    copied), and fail on the first that is not plain data.

    Raises:
        pickle.UnpicklingError: naming the file, relative to ``checkpoint``.
    """
    import pickle

    root = Path(checkpoint).resolve()
    for path in torch_files(root):
        try:
            load_weights_only(path, map_location="cpu", mmap=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
            name = path.name if root.is_file() else path.relative_to(root).as_posix()
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
            why = next((line for line in lines if line.startswith("WeightsUnpickler error")), lines[0])
            raise pickle.UnpicklingError(f"{name} is not plain data that loads with weights_only=True ({why[:200]})") from None
