"""``RolloutCallback``: rollouts before each training step, weight sync after it."""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl

from arctic_rl.rollout.engine import RolloutEngine
from arctic_rl.rollout.generation import generate_rollout
from arctic_rl.weight_sync import InProcessWeightSync


def make_engine(
    kind: str, model_path: str, *, dtype: str, max_model_len: int, seed: int, device: str, engine_kwargs: dict[str, Any]
) -> RolloutEngine:
    """Start the rollout engine ``kind`` (``auto``: vLLM when installed, else transformers)."""
    if kind == "auto":
        kind = "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
    if kind == "vllm":
        from arctic_rl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, dtype=dtype, max_model_len=max_model_len, seed=seed, **engine_kwargs)
    if kind == "transformers":
        from arctic_rl.rollout.hf_engine import TransformersEngine

        return TransformersEngine(model_path, dtype=dtype, device=device, **engine_kwargs)
    raise ValueError(f"RolloutCallback.engine must be 'auto', 'vllm' or 'transformers', got {kind!r}")


class RolloutCallback(pl.Callback):
    """Generates with a rollout engine before each training step and pushes the new weights after.

    Args:
        engine: ``auto`` (vLLM when installed), ``vllm`` or ``transformers``.
        engine_kwargs: extra arguments of the engine (e.g. ``gpu_memory_utilization`` for vLLM).
        log_samples_every_n_steps: write sample completions (a W&B table and ``samples.jsonl``) this
            often; 0 turns it off.
        num_logged_samples: completions per sample log.
    """

    def __init__(
        self,
        engine: Literal["auto", "vllm", "transformers"] = "auto",
        engine_kwargs: dict[str, Any] | None = None,
        log_samples_every_n_steps: int = 20,
        num_logged_samples: int = 8,
    ) -> None:
        if engine not in ("auto", "vllm", "transformers"):
            raise ValueError(f"RolloutCallback.engine must be 'auto', 'vllm' or 'transformers', got {engine!r}")
        self.engine_kind, self.engine_kwargs = engine, dict(engine_kwargs or {})
        self.log_samples_every_n_steps, self.num_logged_samples = log_samples_every_n_steps, num_logged_samples
        self.engine: RolloutEngine | None = None
        self._engine_dir: str | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module) -> None:
        # the engine starts from the trainer's weights as they are now (fresh, or restored from --ckpt_path)
        self._engine_dir = tempfile.mkdtemp(prefix="arctic-rl-engine-")
        pl_module.save_policy(self._engine_dir)
        hp = pl_module.hparams
        self.engine = make_engine(
            self.engine_kind,
            self._engine_dir,
            dtype=hp.dtype,
            max_model_len=pl_module.max_prompt_length + pl_module.max_response_length,
            seed=hp.seed,
            device=str(pl_module.device),
            engine_kwargs=self.engine_kwargs,
        )
        self.weight_sync = InProcessWeightSync(self.engine)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module, batch: dict, batch_idx: int) -> None:
        self.engine.wake_up()
        rollout, metrics = generate_rollout(self.engine, pl_module, batch, trainer.global_step)
        self.engine.sleep()
        batch["rollout"], batch["rollout_metrics"] = rollout, metrics
        every = self.log_samples_every_n_steps
        if every and trainer.global_step % every == 0:
            self._log_samples(trainer, rollout)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs: Any, batch: dict, batch_idx: int) -> None:
        report = self.weight_sync.sync(pl_module.named_parameters_for_sync())
        pl_module.log("timing/sync_s", report.seconds, batch_size=1)
        pl_module.log("sync/gbytes", report.bytes / 1e9, batch_size=1)

    def _log_samples(self, trainer: pl.Trainer, rollout) -> None:
        k = min(self.num_logged_samples, rollout.num_sequences)
        rows = [[trainer.global_step, str(rollout.prompts[i]), rollout.completions[i], rollout.rewards[i].item()] for i in range(k)]
        for logger in trainer.loggers:
            if type(logger).__name__ == "WandbLogger":
                logger.log_table(key="samples", columns=["step", "prompt", "completion", "reward"], data=rows)
        if trainer.log_dir and trainer.is_global_zero:
            Path(trainer.log_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(trainer.log_dir) / "samples.jsonl", "a") as f:
                for step, prompt, completion, reward in rows:
                    f.write(json.dumps({"step": step, "prompt": prompt, "completion": completion, "reward": reward}) + "\n")

    def _shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._engine_dir is not None:
            shutil.rmtree(self._engine_dir, ignore_errors=True)
            self._engine_dir = None

    def on_fit_end(self, trainer: pl.Trainer, pl_module) -> None:
        self._shutdown()

    def on_exception(self, trainer: pl.Trainer, pl_module, exception: BaseException) -> None:
        self._shutdown()
