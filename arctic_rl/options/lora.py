"""The ``lora`` option section (``model.init_args.lora``; the service's ``lora`` section): the rank, scale and
target layers of LoRA adapters through peft (``modules/lora.py`` applies them)."""

from __future__ import annotations

from dataclasses import dataclass

from arctic_rl.errors import ConfigError


@dataclass(frozen=True)
class LoraOptions:
    """LoRA adapters through ``peft`` (``model.init_args.lora``): train ``rank``-``r`` adapters on the decoder's
    linear layers and keep the base weights frozen. Engines receive the merged weights; checkpoints hold the
    adapters only. Needs the ``lora`` extra (``pip install 'arctic-rl[lora]'``).

    Args:
        rank: the adapters' rank r; 0: no LoRA, every weight trains.
        alpha: peft's ``lora_alpha``: the update is scaled by ``alpha / rank``. None: ``rank`` (scale 1).
        target_modules: names of the linear layers that get adapters (the last part of a module's name,
            e.g. ``q_proj``); each must name a linear layer of the decoder. None: every linear layer of the
            decoder (not the output head).
    """

    rank: int = 0
    alpha: float | None = None
    target_modules: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError(f"model.lora.rank must be an integer >= 1 (0: no LoRA), got {self.rank!r}")
        if self.alpha is not None and not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ConfigError(f"model.lora.alpha must be > 0 (or null: rank), got {self.alpha!r}")
        if self.target_modules is not None and (
                isinstance(self.target_modules, str) or not self.target_modules
                or not all(isinstance(name, str) and name for name in self.target_modules)):
            raise ConfigError(f"model.lora.target_modules must be a non-empty list of module names (or null: every "
                              f"linear layer of the decoder), got {self.target_modules!r}")
        if not self.rank and (self.alpha is not None or self.target_modules is not None):
            raise ConfigError("model.lora.rank must be >= 1 where model.lora.alpha or model.lora.target_modules is set "
                              "(they configure LoRA adapters)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank
