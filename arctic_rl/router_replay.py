"""Router replay (R3) for mixture-of-experts models: record the experts each MoE router chose for every token, and
make a later forward route every token to those same experts (``model.init_args.corrections.router_replay``).

Why: a MoE policy's sampler and trainer compute the router's logits with different kernels and batch shapes, so on
near-tied logits their top-k differ; each flip sends a token through other experts and the trainer's log-prob of a
sampled token drifts from the sampler's by far more than the rounding of a dense model. Replay removes that source.

How: :func:`install_router_hooks` gives each router module of a known family (``ROUTERS``: transformers 5.17-5.19's
``*TopKRouter`` of Qwen3-MoE, Qwen2-MoE, OLMoE and Mixtral) its own ``forward`` (``patches/transformers.py``), which runs
the class's forward and then, only inside one of the two contexts below, either
- records its top-k indices (:func:`recording`, the rollout engine: a sink gets ``(moe_layer, indices [N, k])``), or
- replays (:func:`replaying`, the trainer): the indices become the recorded ones and the weights are the trainer's own
  softmax probabilities at those indices (renormalised where the family renormalises its top-k), so gradients reach
  the router through the replayed experts' weights. A token recorded as ``-1`` (not routed by the sampler, e.g. a
  response's last token, never fed back; or padding) keeps the trainer's own choice.
Outside both contexts the router runs as its class does. When the replayed indices equal the router's own, its outputs
are bit-identical to the class forward's.

Activation checkpointing: :func:`checkpoint_contexts` is a torch checkpoint ``context_fn``; it captures the plan active
when a checkpointed layer runs forward and puts it back for that layer's recompute in backward, so the recompute routes
as its forward did (``checkpointing.py`` composes it with selective checkpointing's contexts).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from arctic_rl.errors import ConfigError
from arctic_rl.patches.transformers import override_forward

NOT_ROUTED = -1  # a token whose experts were not recorded: the trainer routes it itself
ROUTING_DTYPE = torch.int16  # expert indices as carried from the engine to the trainer (families up to 32k experts)

# router class -> whether it renormalises its top-k probabilities to sum to one (transformers 5.17-5.19)
ROUTERS: dict[str, Callable[[torch.nn.Module], bool]] = {
    "Qwen3MoeTopKRouter": lambda router: bool(router.norm_topk_prob),
    "Qwen2MoeTopKRouter": lambda router: bool(router.norm_topk_prob),
    "OlmoeTopKRouter": lambda router: bool(router.norm_topk_prob),
    "MixtralTopKRouter": lambda router: True,
}
_active = threading.local()  # .sink (recording) or .plan (replaying), on the thread running the forward


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (index = MoE layer). A router of a family ``ROUTERS`` does not know
    (a class named ``*Router``) raises ``ConfigError``; a dense model has none."""
    routers = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in ROUTERS:
            routers.append(module)
        elif kind.endswith("Router"):
            raise ConfigError(f"corrections.router_replay: {name} is a {kind}, whose top-k selection router replay does not "
                              f"know; known routers: {', '.join(ROUTERS)}")
    return routers


def install_router_hooks(model: torch.nn.Module) -> int:
    """Give every router of ``model`` the recording/replaying forward (idempotent); returns how many MoE layers. A
    model without a MoE router raises ``ConfigError`` (nothing to record or replay)."""
    routers = moe_routers(model)
    if not routers:
        raise ConfigError(f"corrections.router_replay needs a mixture-of-experts model with a known router ({', '.join(ROUTERS)});"
                          f" model type {model.config.model_type!r} has none")
    for layer, router in enumerate(routers):
        router._replay_layer = layer
        router._replay_normalises = ROUTERS[type(router).__name__](router)
        override_forward(router, _routed_forward)
    return len(routers)


def routing_shape(model: torch.nn.Module) -> tuple[int, int]:
    """``(moe_layers, top_k)`` of the model's routers."""
    routers = moe_routers(model)
    return len(routers), int(routers[0].top_k) if routers else 0


@dataclass
class ReplayPlan:
    """The experts to replay in one forward: ``indices [N, M, k]`` (long; ``NOT_ROUTED``: the router's own choice) for the
    forward's ``N`` tokens in the order the router sees them (batch-major, flattened), ``M`` MoE layers. While
    ``counting``, each router adds up, over the replayed tokens, the (token, layer) pairs whose own top-k set differs from
    the replayed one (``mismatched``) and those replayed (``replayed``), and per token (``token_mismatch``: any layer)."""

    indices: torch.Tensor  # [N, M, k] long
    counting: bool = True
    mismatched: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    replayed: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    token_mismatch: torch.Tensor | None = None  # [N] bool, any layer differs

    def __post_init__(self) -> None:
        device = self.indices.device
        self.mismatched, self.replayed = self.mismatched.to(device), self.replayed.to(device)
        self.token_mismatch = torch.zeros(self.indices.shape[0], dtype=torch.bool, device=device)


@contextlib.contextmanager
def recording(sink: Callable[[int, torch.Tensor], None]) -> Iterator[None]:
    """Within: every hooked router calls ``sink(moe_layer, indices [N, k])`` with its own top-k of each forward."""
    previous = getattr(_active, "sink", None)
    _active.sink = sink
    try:
        yield
    finally:
        _active.sink = previous


@contextlib.contextmanager
def replaying(plan: ReplayPlan | None) -> Iterator[ReplayPlan | None]:
    """Within: every hooked router replays ``plan`` (None: routes as usual)."""
    previous = getattr(_active, "plan", None)
    _active.plan = plan
    try:
        yield plan
    finally:
        _active.plan = previous


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch checkpoint's ``context_fn``: the forward runs as is; the recompute replays the plan its forward had
    (without counting mismatches twice)."""
    plan = getattr(_active, "plan", None)
    again = None if plan is None else ReplayPlan(plan.indices, counting=False)
    return contextlib.nullcontext(), replaying(again)


def _routed_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    """A ``*TopKRouter``'s forward, recording or replaying (module docstring). Returns the class's
    ``(router_logits [N, E], weights [N, k], indices [N, k])``."""
    logits, weights, own = type(self).forward(self, hidden_states)
    sink = getattr(_active, "sink", None)
    if sink is not None:
        sink(self._replay_layer, own)
    plan = getattr(_active, "plan", None)
    if plan is None:
        return logits, weights, own
    wanted = plan.indices[:, self._replay_layer]
    if wanted.shape != own.shape:
        raise RuntimeError(f"router replay: MoE layer {self._replay_layer} routes {tuple(own.shape)} (tokens, top-k), the "
                           f"replay plan holds {tuple(wanted.shape)}")
    replayed = wanted != NOT_ROUTED  # [N, k]; a token is recorded whole or not at all
    chosen = torch.where(replayed, wanted, own)
    if plan.counting:
        differs = (own.sort(-1).values != chosen.sort(-1).values).any(-1) & replayed[:, 0]
        plan.mismatched += differs.sum()
        plan.replayed += replayed[:, 0].sum()
        plan.token_mismatch |= differs
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.gather(-1, chosen)
    if self._replay_normalises:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(weights.dtype), chosen


@dataclass
class RoutedTokens:
    """A batch's recorded routing (``RolloutBatch.routed_experts [N, W, M, k]``: row ``i``'s prompt at ``0..P_i-1``, its
    response from ``P_i`` on) and the replay plans built from it, one per forward (whose metrics it sums)."""

    routing: torch.Tensor  # [N, W, M, k] int16, NOT_ROUTED where none
    plans: list[ReplayPlan] = field(default_factory=list)

    def plan(self, addresses: torch.Tensor) -> ReplayPlan:
        """The plan of a forward whose tokens, in the routers' order, are ``addresses`` (flat indices ``i * W + j`` into the
        routing; negative: a token with no recording, e.g. padding)."""
        n, w = self.routing.shape[:2]
        flat = self.routing.reshape(n * w, *self.routing.shape[2:])
        where = addresses.reshape(-1).to(flat.device)
        picked = flat.index_select(0, where.clamp(min=0)).long()
        picked[where < 0] = NOT_ROUTED
        plan = ReplayPlan(picked)
        self.plans.append(plan)
        return plan

    def naive_addresses(self, total: int) -> torch.Tensor:
        """``[N, total]`` addresses of the naive layout (row ``i`` = prompt ``i`` + response ``i``, right-padded)."""
        n, w = self.routing.shape[:2]
        column = torch.arange(total, device=self.routing.device)
        addresses = torch.arange(n, device=self.routing.device)[:, None] * w + column[None]
        return torch.where(column[None] < w, addresses, NOT_ROUTED)

    def metrics(self) -> dict[str, float]:
        """Over every counted forward: ``router/mismatch``, the share of replayed (token, MoE layer) choices whose trainer
        top-k set differs from the sampler's; ``router/mismatch_tokens``, the share of replayed tokens with such a
        difference at any layer."""
        counted = [p for p in self.plans if p.counting]
        replayed = sum(int(p.replayed) for p in counted)
        tokens = sum(int((p.indices[:, 0, 0] != NOT_ROUTED).sum()) for p in counted)
        return {"router/mismatch": sum(int(p.mismatched) for p in counted) / max(replayed, 1),
                "router/mismatch_tokens": sum(int(p.token_mismatch.sum()) for p in counted) / max(tokens, 1)}
