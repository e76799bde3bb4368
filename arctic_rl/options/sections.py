"""``GRPOModule``'s options, grouped: one typed dataclass per concern, each field with its default, its
documentation and its own checks; :class:`ModuleOptions` is the tree of all sections (``options.sampling.temperature``).
``arctic-rl fit`` YAML (``model.init_args.<section>.<field>``), Python callers and the service all pass these; a new
option is added here, once.

Sections (:data:`SECTIONS`): ``sampling`` (what the engines sample), ``rollout`` (rewards to advantages;
``options/rollout.py``), ``optim`` (optimizer, schedule, steps per rollout batch), ``compute`` (how a step is
computed: micro-batches, ZoRRo, kernels; never what), ``loss`` and ``regularizers`` (``options/loss.py``),
``corrections`` (``options/corrections.py``), ``ref_sync`` (reference-model updates) and ``lora``
(``options/lora.py``: LoRA adapters through peft).

Checks that need two sections or the model (context length, tokenizer) stay in ``modules/validation.py``; those
that need the data or the trainer run at ``setup``. The old flat keys (``model.init_args.temperature``) are read by
``modules/flat_options.py`` for one release.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from arctic_rl.errors import ConfigError, check_number, check_positive
from arctic_rl.options.corrections import CorrectionConfig
from arctic_rl.options.lora import LoraOptions
from arctic_rl.options.loss import LossConfig, Regularizers
from arctic_rl.options.rollout import RolloutOptions

LR_SCHEDULES = ("constant", "linear", "cosine")
AttentionBackend = Literal["auto", "flex", "cudnn", "flash_varlen", "sdpa"]
ZorroDedup = Literal["group", "tree"]
ZORRO_DEDUP = ("group", "tree")
GradientCheckpointing = bool | Literal["full", "selective"]  # checkpointing.py runs it
LigerSetting = bool | Literal["auto"]  # liger.py resolves it


def checkpointing_mode(setting: Any) -> str:
    """``"off"``, ``"full"`` or ``"selective"`` for a ``gradient_checkpointing`` value; a clear error otherwise."""
    if setting is False or setting is None:
        return "off"
    if setting is True or setting == "full":
        return "full"
    if setting == "selective":
        return "selective"
    raise ConfigError(f"model.compute.gradient_checkpointing must be false, true, 'full' or 'selective', got {setting!r}")


@dataclass(frozen=True)
class SamplingOptions:
    """What the rollout engines sample (``model.init_args.sampling``).

    Args:
        group_size: G, completions sampled per prompt (>= 2); None only where the requests bring their own groups
            (the service).
        max_prompt_length: longest prompt in tokens; longer prompts are an error at setup.
        max_response_length: tokens generated per completion at most.
        temperature: sampling temperature (log-probs are computed at the same temperature).
        top_p: nucleus sampling.
        seed: base seed of the rollout sampler (each step, prompt slot and sample its own stream:
            rollout/engines/seeds.py); None: unseeded, each engine samples from its own random state.
    """

    group_size: int | None = 8
    max_prompt_length: int = 512
    max_response_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = 0

    def __post_init__(self) -> None:
        check_positive(**{"sampling.max_response_length": self.max_response_length,
                          "sampling.max_prompt_length": self.max_prompt_length})
        if self.group_size is not None and self.group_size < 2:
            raise ConfigError(f"model.sampling.group_size must be >= 2 (GRPO compares samples within a group), got {self.group_size}")
        if not 0 < self.temperature:  # also refuses NaN
            raise ConfigError(f"model.sampling.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"model.sampling.top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class OptimOptions:
    """The optimizer (AdamW), its schedule, and the optimizer steps per rollout batch (``model.init_args.optim``).

    Args:
        learning_rate: AdamW learning rate.
        lr_schedule: ``constant``, ``linear`` or ``cosine`` decay to 0 over the run (max_steps or max_epochs).
        warmup_steps: linear warm-up optimizer steps.
        min_lr_ratio: ``cosine`` only: the floor of the decay, a fraction of ``learning_rate`` (verl's).
        num_cycles: ``cosine`` only: waves of the cosine over the decay (0.5: down once; verl's).
        weight_decay: AdamW weight decay.
        max_grad_norm: clip the gradient norm to this (None or 0: no clipping, as in TRL; the norm is still logged).
        mini_batches: optimizer steps per rollout batch (the batch is split into this many).
        num_iterations: passes over each rollout batch (TRL; GRPO's mu), each of ``mini_batches`` optimizer steps.
    """

    learning_rate: float = 1e-6
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    mini_batches: int = 1
    num_iterations: int = 1

    def __post_init__(self) -> None:
        check_positive(**{"optim.mini_batches": self.mini_batches, "optim.num_iterations": self.num_iterations})
        check_number("optim.learning_rate", self.learning_rate, 0.0)
        check_number("optim.weight_decay", self.weight_decay, 0.0)
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"model.optim.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.max_grad_norm is not None:  # 0 means no clipping, as in TRL and transformers
            check_number("optim.max_grad_norm", self.max_grad_norm, 0.0)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"model.optim.lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        check_number("optim.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_number("optim.num_cycles", self.num_cycles, 0.0, low_open=True)
        if self.lr_schedule != "cosine" and (self.min_lr_ratio, self.num_cycles) != (0.0, 0.5):
            raise ConfigError("model.optim.min_lr_ratio and num_cycles shape the cosine schedule: set"
                              f" model.optim.lr_schedule 'cosine' (got {self.lr_schedule!r}) or leave them 0.0 and 0.5")


@dataclass(frozen=True)
class ComputeOptions:
    """How a step is computed, never what: every setting here gives the same gradients (``model.init_args.compute``).

    Args:
        micro_batch_size: sequences per forward/backward (None: a whole mini-batch at once).
        micro_batch_tokens: instead of ``micro_batch_size``, a token budget per forward/backward, with
            each shared prompt counted once (ZoRRo): whole prompt groups are packed together where they
            fit, larger groups split into pieces that repeat the prompt.
        balance_ranks: with ``micro_batch_tokens`` and several data-parallel ranks, re-deal each
            mini-batch's prompt groups over the ranks so they carry about equal packed tokens (largest
            first, to the least-loaded rank) before the forward/backward passes. Exact: the loss
            normalisers are global, so where a group is computed does not change the gradient.
        gradient_checkpointing: recompute each decoder layer's activations in backward (non-reentrant)
            instead of keeping them. ``true`` (or ``full``): much less memory for about a third more compute (every
            matmul runs again). ``selective``: the matmul and attention outputs are kept and only the elementwise
            work is replayed: memory between the two, compute nearly that of ``false``
            (``arctic_rl/checkpointing.py``).
        zorro: compute each group's shared prompt once (ZoRRo Train; exact, same gradients) in every
            log-prob pass: training, old-policy and reference. False: the naive per-sequence batch.
        attention_backend: ZoRRo's attention: ``auto`` (FlexAttention on GPU, masked SDPA on CPU), ``flex``,
            ``cudnn`` (cascade attention on cuDNN; fastest when lengths repeat, each new shape costs a graph
            build), ``flash_varlen`` (cascade on FlashAttention-2 varlen) or ``sdpa``. Cascades need bf16/fp16 CUDA.
        zorro_dedup: what ZoRRo computes once: ``group`` (each group's shared prompt; every backend) or ``tree``
            (the batch as a prefix tree: every token whose prefix several sequences share, at any depth, e.g. the
            first turns of multi-turn or tree rollouts and common chat templates; exact, same gradients;
            ``auto``/``flex``/``sdpa`` backends, not hybrid linear-attention models; responses may have mask holes).
        sequence_parallel: Ulysses sequence parallelism: each packed (deduplicated) ZoRRo row is split over this many
            ranks, which exchange it at every attention layer (all-to-all: my rows, all heads <-> all rows, my heads;
            ``arctic_rl/zorro/sequence_parallel.py``). The world of W ranks forms W/N groups of N consecutive ranks;
            each rank samples its own share as in data parallelism, and each group computes the union of its ranks'
            shares, every rank a 1/N slice of each row: exact, same gradients. ``micro_batch_size`` /
            ``micro_batch_tokens`` then measure the group's micro-batches (each rank holds 1/N of their tokens). 1: off. Needs ``zorro`` and query
            head counts divisible by it; every attention backend runs under it.
        liger: Liger's fused RMSNorm/SwiGLU/RoPE kernels (``arctic_rl/liger.py``): ``auto`` (CUDA + liger-kernel), true, false.
        self_check: before the first optimizer step, check the log-prob paths (ZoRRo, naive) against the
            model's own forward on a probe of the first batch; stop with a clear error if they differ.
    """

    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = None
    balance_ranks: bool = True
    gradient_checkpointing: GradientCheckpointing = False
    zorro: bool = True
    attention_backend: AttentionBackend = "auto"
    zorro_dedup: ZorroDedup = "group"
    sequence_parallel: int = 1
    liger: LigerSetting = "auto"
    self_check: bool = True

    def __post_init__(self) -> None:
        checkpointing_mode(self.gradient_checkpointing)  # a clear error for another value
        if self.micro_batch_size is not None:
            check_positive(**{"compute.micro_batch_size": self.micro_batch_size})
        if self.micro_batch_size is not None and self.micro_batch_tokens is not None:
            raise ConfigError("set model.compute.micro_batch_size or model.compute.micro_batch_tokens, not both")
        if self.micro_batch_tokens is not None:
            check_positive(**{"compute.micro_batch_tokens": self.micro_batch_tokens})
        if self.zorro_dedup not in ZORRO_DEDUP:
            raise ConfigError(f"model.compute.zorro_dedup must be one of {', '.join(ZORRO_DEDUP)}, got {self.zorro_dedup!r}")
        if self.zorro_dedup == "tree" and not self.zorro:
            raise ConfigError("model.compute.zorro_dedup 'tree' is a ZoRRo packing: it needs model.compute.zorro true")
        check_positive(**{"compute.sequence_parallel": self.sequence_parallel})
        if self.sequence_parallel > 1 and not self.zorro:
            raise ConfigError(f"model.compute.sequence_parallel={self.sequence_parallel} splits ZoRRo's packed rows: it needs "
                              "model.compute.zorro true (the naive per-sequence path is not split)")
        if self.zorro_dedup == "tree" and self.attention_backend in ("cudnn", "flash_varlen"):
            raise ConfigError(f"model.compute.zorro_dedup 'tree' runs on the flex or sdpa attention backends (auto picks "
                              f"them); {self.attention_backend!r} is cascade attention over one shared prompt per group: "
                              "set model.compute.attention_backend to auto, flex or sdpa, or zorro_dedup to group")


@dataclass(frozen=True)
class RefSyncOptions:
    """TRL's reference-model updates (``ref_sync.py``; ``model.init_args.ref_sync``); need ``regularizers.kl_coef > 0``.

    Args:
        sync_ref_model: every ``ref_model_sync_steps`` optimizer steps, mix the policy into the KL reference.
        ref_model_mixup_alpha: the policy's share in the mix, in [0, 1].
        ref_model_sync_steps: optimizer steps between mixes (>= 1).
    """

    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512

    def __post_init__(self) -> None:
        if not self.sync_ref_model:
            return
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            raise ConfigError(f"model.ref_sync.ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha}")
        if self.ref_model_sync_steps < 1:
            raise ConfigError(f"model.ref_sync.ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps}")


# section name -> its dataclass, in the order of GRPOModule's arguments; a field's name is unique over all sections
SECTIONS: dict[str, type] = {
    "sampling": SamplingOptions, "rollout": RolloutOptions, "optim": OptimOptions, "compute": ComputeOptions,
    "loss": LossConfig, "corrections": CorrectionConfig, "regularizers": Regularizers, "ref_sync": RefSyncOptions,
    "lora": LoraOptions,
}


@dataclass(frozen=True)
class ModuleOptions:
    """Every section, typed: ``GRPOModule.options`` (read as ``options.sampling.temperature``). Its checkpoints keep
    :meth:`as_dict`, sections as plain dicts."""

    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    rollout: RolloutOptions = field(default_factory=RolloutOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    compute: ComputeOptions = field(default_factory=ComputeOptions)
    loss: LossConfig = field(default_factory=LossConfig)
    corrections: CorrectionConfig = field(default_factory=CorrectionConfig)
    regularizers: Regularizers = field(default_factory=Regularizers)
    ref_sync: RefSyncOptions = field(default_factory=RefSyncOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)

    def __post_init__(self) -> None:
        if self.corrections.router_replay and self.compute.zorro and self.compute.zorro_dedup != "group":
            raise ConfigError("model.corrections.router_replay maps each recorded token to its place in ZoRRo's shared-prompt"
                              f" layout; model.compute.zorro_dedup must be 'group', got {self.compute.zorro_dedup!r}")
        if self.rollout.agent is not None and self.optim.mini_batches > 1:
            raise ConfigError("model.rollout.agent takes model.optim.mini_batches 1 (an episode the endpoint split trains its later"
                              f" sequences as rows after the batch's groups, which equal mini-batches cannot cut), got {self.optim.mini_batches}")
        for episodes in ("environment", "agent"):
            if self.corrections.router_replay and getattr(self.rollout, episodes) is not None:
                raise ConfigError(f"model.corrections.router_replay does not take model.rollout.{episodes} yet (a multi-turn"
                                  " episode's environment tokens are not routed by the engine)")

    def as_dict(self) -> dict[str, dict]:
        """``{section: {field: value}}``, plain data: what checkpoints and ``hparams.yaml`` keep."""
        return {f.name: asdict(getattr(self, f.name)) for f in fields(self)}


assert tuple(SECTIONS) == tuple(f.name for f in fields(ModuleOptions))
