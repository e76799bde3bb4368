"""verl 0.9.1 backend: ``actor_rollout_ref.actor.strategy: arctic_rl`` trains verl's actor, computes its
log-probs and samples its rollouts through one ``ArcticRLClient`` (ZoRRo log-probs, arctic-rl's loss family,
its DeepSpeed backend and rollout engines).

Where it plugs in, and why there: verl 0.9.1's engine workers (``verl.workers.engine_workers``:
``ActorRolloutRefWorker`` -> ``TrainingWorker``) build the actor with ``EngineRegistry.new(model_type,
backend=engine_config.strategy)`` and drive it only through the ``BaseEngine`` interface:
``infer_batch`` (old/ref log-probs), ``train_batch`` = ``optimizer_zero_grad`` + ``forward_backward_batch``
+ ``optimizer_step``, ``lr_scheduler_step``, ``get_per_tensor_param``, checkpoints. Registering
``ArcticRLEngine`` there lets verl's own worker code (mini-batching, epochs, metrics, its ``TensorDict``
layout) run unchanged, and the boundary is the same one verl's FSDP, Megatron and Tinker paths use. The
one seam: verl hands the engine its ``ppo_loss`` as a callable over differentiable log-probs, while
arctic-rl computes the loss in its own process; the engine therefore maps that loss's ``ActorConfig``
(clip ratios, ``loss_agg_mode``, ...) onto a registered arctic-rl loss (``verl_mapping.loss_settings``) and
refuses settings it cannot honour exactly. Rollouts: ``ArcticRLRollout`` is a verl ``BaseRollout`` whose
``generate_sequences`` samples from the same client (so weights never leave arctic-rl; ``update_weights``
is ``sync_weights``); verl's agent loop (``main_ppo``) samples through ``verl_replica.ArcticRLReplica``, whose
server calls that client in the worker; verl's own rollouts get the weights from ``get_per_tensor_param``.

Use: ``import arctic_rl.integrations.verl`` in verl's worker processes (``actor_rollout_ref.model.external_lib=
arctic_rl.integrations.verl``) registers the engine; see docs/verl.md.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import torch
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.config import ActorConfig, EngineConfig, FSDPActorConfig
from verl.workers.engine import BaseEngine, EngineRegistry
from verl.workers.rollout.base import BaseRollout

from arctic_rl.integrations import verl_replica
from arctic_rl.integrations.verl_mapping import (UnsupportedVerlSetting, loss_settings, schedule_settings, to_verl_jagged,
                                                 train_batch_from_verl)
from arctic_rl.serve.client import ArcticRLClient

STRATEGY = "arctic_rl"


@dataclass
class ArcticRLEngineConfig(EngineConfig):
    """verl engine config of the arctic_rl strategy: ``client`` is an ``ArcticRLClientConfig`` (dict or YAML
    path); its ``model``, ``dtype``, learning rate, schedule, weight decay and clipping are set from verl's model and
    optim sections and this ``dtype`` (verl's values win); ``reference_model`` (the service keeps a frozen copy of
    the initial policy) is set from the actor's ``use_kl_loss``. ``loss_config``: the own keys of the plugin loss
    that ``policy_loss.loss_mode`` names (``verl_mapping.loss_settings``)."""

    strategy: str = STRATEGY
    dtype: str = "float32"
    client: Any = None
    reference_model: bool = False
    loss_config: Any = None

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != STRATEGY:
            raise ValueError(f"ArcticRLEngineConfig.strategy must be {STRATEGY!r}, got {self.strategy!r}")
        object.__setattr__(self, "client", _plain(self.client))  # verl's configs are frozen dataclasses
        object.__setattr__(self, "loss_config", _plain(self.loss_config))


@dataclass
class ArcticRLActorConfig(FSDPActorConfig):
    """``actor_rollout_ref.actor`` for the arctic_rl strategy (``_target_: arctic_rl.integrations.verl.
    ArcticRLActorConfig``): accepts verl's default (dp) actor section unchanged, its ``fsdp_config`` unused,
    plus an ``arctic_rl`` engine section (``client``: the ``ArcticRLClientConfig``; ``loss_config``: a plugin
    loss's own keys). Its loss settings are checked when it is built (``verl_mapping.loss_settings``)."""

    strategy: str = STRATEGY
    arctic_rl: Any = None

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != STRATEGY:
            raise ValueError(f"ArcticRLActorConfig.strategy must be {STRATEGY!r}, got {self.strategy!r}")
        engine = self.arctic_rl
        if not isinstance(engine, ArcticRLEngineConfig):
            engine = ArcticRLEngineConfig(**_plain(engine or {}))
        object.__setattr__(engine, "reference_model", bool(self.use_kl_loss))  # the ref worker's log-probs: the service's
        object.__setattr__(self, "arctic_rl", engine)
        self.engine = engine
        loss_settings(self, engine.loss_config)  # a setting the strategy cannot honour fails here, not at the first step


def _plain(value: Any) -> Any:
    """An OmegaConf node (hydra hands sections over as ``DictConfig``) as plain dicts and lists."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def client_overrides(model_config, optimizer_config, engine_config: ArcticRLEngineConfig) -> dict[str, Any]:
    """The client config fields verl's sections decide: the model (``actor_rollout_ref.model.path``), dtype,
    AdamW's rate, weight decay and clipping, the schedule (``verl_mapping.schedule_settings``) and the reference
    model. Betas other than AdamW's defaults are refused."""
    if tuple(optimizer_config.betas) != (0.9, 0.999):
        raise UnsupportedVerlSetting(f"actor_rollout_ref.actor.optim.betas={optimizer_config.betas!r}: arctic-rl's AdamW "
                                     "uses (0.9, 0.999)")
    schedule = schedule_settings(optimizer_config)
    training = {"total_steps": schedule.pop("total_steps")} if "total_steps" in schedule else {}
    optim = {"learning_rate": optimizer_config.lr, "weight_decay": optimizer_config.weight_decay,
             "max_grad_norm": optimizer_config.clip_grad, **schedule}
    if engine_config.reference_model:
        training["reference_model"] = True
    return {"model": model_config.local_path or model_config.path, "dtype": engine_config.dtype, "optim": optim, "training": training}


@EngineRegistry.register(model_type="language_model", backend=STRATEGY, device=["cuda", "cpu", "npu"])
class ArcticRLEngine(BaseEngine):
    """verl's ``BaseEngine`` over an ``ArcticRLClient``: one optimizer step of verl's is one arctic-rl
    ``forward_backward`` + ``optim_step``; log-probs come from ``forward`` (ZoRRo). verl's reference worker
    (``actor_rollout_ref.ref``, its forward-only engine config with ``strategy: arctic_rl``) is an instance too,
    without a client of its own: its log-probs are the actor's service's reference model's (``ref_logprobs``)."""

    def __init__(self, model_config, engine_config: ArcticRLEngineConfig, optimizer_config, checkpoint_config, **_):
        self.is_reference = not isinstance(engine_config, ArcticRLEngineConfig)
        if self.is_reference and not engine_config.forward_only:
            raise UnsupportedVerlSetting(
                f"the {STRATEGY} strategy needs an ArcticRLEngineConfig, got {type(engine_config).__name__}: only the actor "
                "(actor_rollout_ref.actor._target_: arctic_rl.integrations.verl.ArcticRLActorConfig) and its forward-only "
                "reference (actor_rollout_ref.ref) run on arctic-rl")
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.client: ArcticRLClient | None = None
        self.mode = None
        self._lr: float | None = None
        self._advance_schedule = True  # verl advances its schedule after a training step's last mini-batch only

    # ------------------------------------------------------------------ lifecycle
    def initialize(self):
        if self.is_reference:
            return  # built before the actor in verl's worker: the actor's client is found at the first call
        if self.client is None:
            overrides = {} if self.optimizer_config is None else client_overrides(
                self.model_config, self.optimizer_config, self.engine_config)
            self.client = ArcticRLClient(self.engine_config.client, **overrides)
            verl_replica.register_worker_client(self.client)  # the rollout of this worker samples with it
        self.client.status()  # the first call builds the model and starts the engines

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    @contextmanager
    def _mode(self, mode: str):
        self.mode = mode
        try:
            yield
        finally:
            self.mode = None

    def train_mode(self, **kwargs):
        return self._mode("train")

    def eval_mode(self, **kwargs):
        return self._mode("eval")

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """Placement is arctic-rl's (``sleep``/``wake`` for colocated engines); nothing to move here."""

    def get_data_parallel_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group(self):
        return None

    def is_mp_src_rank_with_outputs(self):
        return True

    # ------------------------------------------------------------------ compute
    def optimizer_zero_grad(self):
        self.client.zero_grad()

    def optimizer_step(self):
        """arctic-rl's step: clipping to ``optim.max_grad_norm`` (verl's ``clip_grad``); its schedule advances
        only after the last mini-batch of verl's training step (verl's ``update_lr_scheduler``), as verl's does."""
        stepped = self.client.optim_step(advance_schedule=self._advance_schedule)
        self._lr = stepped["lr"]
        return stepped["grad_norm"]

    def lr_scheduler_step(self):
        """The learning rate of the next step, as verl's FSDP engine reports it (arctic-rl advanced its schedule
        in the last ``optim_step``)."""
        return float(self.client.status()["lr"])

    def forward_backward_batch(self, data, loss_function, forward_only=False) -> dict[str, Any]:
        """verl's engine contract: ``{"model_output": {"log_probs", "entropy"?} (jagged over input_ids),
        "loss": [float], "metrics": {name: [Metric]}}``; ``forward_only=False`` accumulates gradients."""
        if self.is_reference and self.client is None:
            self.client = verl_replica.worker_client()  # the worker's actor engine, built after this one
        temperature = tu.get(data, "temperature", default=None)
        expected = self.client.config.sampling.temperature
        if temperature is not None and float(temperature) != expected:
            raise UnsupportedVerlSetting(f"log-probs at temperature {temperature}, but the arctic_rl client computes them at "
                                         f"sampling.temperature={expected}; set both equal")
        if forward_only:
            return self._forward(data)
        self._advance_schedule = bool(tu.get(data, "update_lr_scheduler", default=True))
        name, loss_config = loss_settings(_actor_config_of(loss_function), self.engine_config.loss_config)
        metrics = self.client.forward_backward(train_batch_from_verl(data, with_loss_inputs=True), name, loss_config)
        loss = float(metrics.pop("loss"))
        out = {f"actor/{key}": [Metric(AggregationType.MEAN, float(value))] for key, value in metrics.items()
               if isinstance(value, (int, float))}
        out["actor/pg_loss"] = [Metric(AggregationType.MEAN, loss)]
        return {"model_output": {}, "loss": [loss], "metrics": out}

    def _forward(self, data) -> dict[str, Any]:
        if self.is_reference:
            return self._reference_forward(data)
        processors = ["logprobs"] + (["entropy"] if tu.get(data, "calculate_entropy", default=False) else [])
        outputs = self.client.forward(train_batch_from_verl(data, with_loss_inputs=False), processors)
        model_output = {"log_probs": to_verl_jagged(outputs["logprobs"], data)}
        if "entropy" in outputs:
            model_output["entropy"] = to_verl_jagged(outputs["entropy"], data)
        return {"model_output": model_output, "loss": [0.0], "metrics": {}}

    def _reference_forward(self, data) -> dict[str, Any]:
        """verl's ref log-probs: the ``ref_logprobs`` of the actor's service (its frozen initial policy)."""
        if not self.client.config.training.reference_model:
            raise UnsupportedVerlSetting("reference log-probs (actor_rollout_ref.ref) come from the arctic_rl service's "
                                         "reference model, which actor_rollout_ref.actor.use_kl_loss=true turns on; "
                                         "algorithm.use_kl_in_reward is not supported by the arctic_rl strategy")
        outputs = self.client.forward(train_batch_from_verl(data, with_loss_inputs=False), ["ref_logprobs"])
        return {"model_output": {"log_probs": to_verl_jagged(outputs["ref_logprobs"], data)}, "loss": [0.0], "metrics": {}}

    # ------------------------------------------------------------------ weights and checkpoints
    def get_per_tensor_param(self, **kwargs):
        """The policy's weights by Hugging Face name, for verl's own rollouts (vLLM, SGLang): arctic-rl writes
        them as a ``save_pretrained`` directory (``export``, under ``server.root_dir``, rewritten each call) and
        they are read tensor by tensor from there, so the client's server must share this filesystem. Not
        needed with ``ArcticRLRollout``, whose engines arctic-rl syncs itself."""
        from safetensors import safe_open

        self.client.export("verl-weights")
        directory = Path(self.client.config.server.root_dir).resolve() / "verl-weights"  # as the server resolves it

        def tensors():
            for file in sorted(directory.glob("*.safetensors")):
                with safe_open(str(file), "pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        return tensors(), None

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """arctic-rl's ``save_state`` (paths are relative to the client's ``server.root_dir``)."""
        if hdfs_path is not None:
            raise UnsupportedVerlSetting("trainer.default_hdfs_dir: HDFS checkpoints are not supported by the arctic_rl strategy")
        return self.client.save_state(local_path)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        return self.client.load_state(local_path)


class ArcticRLRollout(BaseRollout):
    """verl's ``BaseRollout`` sampled by the actor's ``ArcticRLClient``: ``generate_sequences`` returns verl's
    batch layout (``prompts`` left-padded, ``responses`` right-padded, ``input_ids``, ``attention_mask``,
    ``position_ids``, ``response_mask``, ``rollout_log_probs``), ``rollout.n`` samples of each prompt contiguous
    (as ``DataProto.repeat(n, interleave=True)`` orders them, so verl's ``uid`` groups line up). Built by verl's
    hybrid worker (``rollout.name: arctic_rl``) without ``client``: then the worker's actor engine's client."""

    def __init__(self, config, model_config, device_mesh=None, *, client: ArcticRLClient | None = None, **kwargs):
        super().__init__(config, model_config, device_mesh)
        self.client = verl_replica.worker_client() if client is None else client  # None: built by verl's worker
        if self.config.temperature != self.client.config.sampling.temperature:
            raise UnsupportedVerlSetting(f"actor_rollout_ref.rollout.temperature={self.config.temperature} must equal the "
                                         f"arctic_rl client's sampling.temperature={self.client.config.sampling.temperature} "
                                         "(its log-probs are computed at that temperature)")

    async def resume(self, tags: list[str]):
        self.client.wake()

    async def release(self):
        self.client.sleep()

    async def update_weights(self, weights=None, wire_format: str = "named_tensors", **kwargs):
        """The policy lives in the same arctic-rl job: push its weights into the engines (``weights``: unused)."""
        self.client.sync_weights()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
        prompt_lists = [row[m].tolist() for row, m in zip(ids, mask)]
        if not prompts.meta_info.get("do_sample", True):
            raise UnsupportedVerlSetting("greedy generation (do_sample=False, e.g. validation with val_kwargs.do_sample: "
                                         "false) is not offered by the arctic_rl rollout; sample at the rollout temperature")
        n = int(prompts.meta_info.get("n", self.config.n))
        out = self.client.sample(prompt_lists, n=n, max_tokens=self.config.response_length,
                                 temperature=self.config.temperature, top_p=self.config.top_p,
                                 seed=prompts.meta_info.get("seed"))
        width, count = self.config.response_length, len(prompt_lists) * n
        responses = torch.full((count, width), _pad_id(self.model_config), dtype=torch.long)
        response_mask, logprobs = torch.zeros((count, width), dtype=torch.long), torch.zeros((count, width))
        for i, (tokens, lps) in enumerate(zip(out.flat_token_ids(), out.flat_logprobs())):
            responses[i, :len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
            response_mask[i, :len(tokens)] = 1
            logprobs[i, :len(lps)] = torch.as_tensor(lps)
        repeated = prompts.repeat(repeat_times=n, interleave=True)
        prompt_ids, prompt_mask = repeated.batch["input_ids"], repeated.batch["attention_mask"].long()
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        batch = {"prompts": prompt_ids, "responses": responses, "input_ids": torch.cat([prompt_ids, responses], dim=1),
                 "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
                 "response_mask": response_mask, "rollout_log_probs": logprobs}
        return DataProto.from_dict(tensors=batch, non_tensors=dict(repeated.non_tensor_batch),
                                   meta_info=dict(prompts.meta_info))


def _pad_id(model_config) -> int:
    tokenizer = model_config.tokenizer
    return 0 if tokenizer is None or tokenizer.pad_token_id is None else int(tokenizer.pad_token_id)


def _actor_config_of(loss_function) -> ActorConfig:
    """The ``ActorConfig`` verl bound into its loss (``functools.partial(ppo_loss, config=...)``)."""
    from verl.workers.utils.losses import ppo_loss

    keywords = getattr(loss_function, "keywords", None) or {}
    if getattr(loss_function, "func", None) is not ppo_loss or "config" not in keywords:
        raise UnsupportedVerlSetting(f"the arctic_rl strategy trains with verl's ppo_loss only (got {loss_function!r}); "
                                     "distillation and SFT losses are not mapped")
    return keywords["config"]


verl_replica.register()  # rollout.name: arctic_rl for verl's agent loop (RayPPOTrainer.fit)
