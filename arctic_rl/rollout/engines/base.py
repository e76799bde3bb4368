"""The rollout-engine boundary: what the trainer asks of any generator (vLLM, transformers, or a
Ray actor wrapping either). Keep it narrow; see docs/architecture.md section 2."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample: ``n`` completions per prompt of at most ``max_tokens`` tokens.

    Seeds (``rollout/engines/seeds.py``): every sample of every prompt draws from its own stream. With
    ``prompt_seeds`` (one per prompt, as the rollout callback sets them) sample ``k`` of prompt ``i`` uses
    ``sample_seed(prompt_seeds[i], k)``; with only ``seed``, prompt ``i``'s seed is derived from ``seed``
    and ``i``; with neither, the engine's own random state is used."""

    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    prompt_seeds: tuple[int, ...] | None = None  # [num_prompts]; an engine pool splits it with the prompts
    stop_token_ids: tuple[int, ...] = ()  # besides EOS, tokens that end a completion ("stop"); the token is kept
    # record each token's MoE routing in ``Completion.routed_experts`` (router replay, ``corrections.router_replay``)
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingConfig.stop_token_ids must be token ids (ints >= 0), got {self.stop_token_ids!r}")


@dataclass
class Completion:
    """One sampled completion."""

    token_ids: list[int]  # generated tokens, the stop token included when one was sampled
    logprobs: list[float]  # the sampler's log-probability of each generated token
    finish_reason: str  # "stop" (EOS or stop token) or "length"
    # multi-turn episodes (``multi_turn.py``): the response holds generated and environment tokens
    loss_mask: list[float] | None = None  # per token: 1.0 generated, 0.0 the environment's (None: all generated)
    episode: dict[str, Any] | None = None  # turns, end reason, environment reward ... (None: one turn, no environment)
    weight_version: int | None = None  # the engine's weights when it sampled: 0 at start, +1 per weight sync (None: untold)
    # an engine that ``UpdatesInFlight``: per token, the version of the weights that sampled it (counted as above)
    token_versions: list[int] | None = None
    # with ``SamplingConfig.return_routed_experts``: the experts each MoE layer's router chose for every prompt token and
    # every generated token as an input, ``[P + len(token_ids), M, k]`` int16 (``router_replay.py``), ``-1`` for a token
    # not routed (the last generated token, never fed back)
    routed_experts: torch.Tensor | None = None


class RolloutEngine(Protocol):
    """Generates completions and takes new weights. Implementations must own the model they run
    (no aliasing of trainer parameters), so ``update_weights`` is the only way weights change."""

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """Sample ``sampling.n`` completions for each prompt; result is ``[num_prompts][n]``."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full (unsharded) tensors with Hugging Face parameter names into the engine. One call
        carries every weight (vLLM's in-place reload treats a call as the complete set); the iterator
        may be lazy, so a sender can stream without materialising the model twice."""
        ...

    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Log-prob of each token after the first given its prefix (temperature 1): a cheap way to
        check that the engine's weights equal the trainer's."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory (weights and KV cache) while training runs."""
        ...

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before the next ``generate``."""
        ...

    def shutdown(self) -> None:
        """Free everything the engine holds; the engine is unusable afterwards."""
        ...



@runtime_checkable
class ReceivesInPlace(Protocol):
    """An engine whose weights may be written where they lie: a broadcast weight sync receives each tensor straight
    into the engine's own parameter (no buffer, no copy), then hands it to ``update_weights``, which must then leave
    a tensor that is its own parameter alone. The transformers engine has it; vLLM's fused and re-packed weights do not.
    Engines run one call at a time, so no generation sees a half-received parameter."""

    def weight_target(self, name: str) -> torch.Tensor | None:
        """The tensor holding weight ``name`` (an HF name, as the trainer sends it), or None to receive it into a
        buffer. The receiver uses it only when its shape, dtype and device are the sent tensor's and it is contiguous."""
        ...


@runtime_checkable
class UpdatesInFlight(Protocol):
    """An engine whose ``update_weights`` may be called from another thread while ``generate`` runs: the decode loop
    pauses at its next step boundary, the weights load, and it resumes with the requests it holds (their KV cache kept).
    Its completions carry ``token_versions``. ``weight_version`` counts the updates loaded (0: the start-up weights).
    ``engines/in_flight.py`` has the protocol between the two threads."""

    @property
    def weight_version(self) -> int:
        ...


@dataclass(frozen=True)
class DecodeStep:
    """The tokens one decode step added, per row of a ``generate`` call (row ``i * n + k``: prompt ``i``'s sample
    ``k``). A row's tokens over the call's steps, in order, are its completion's ``token_ids``."""

    token_ids: list[list[int]]  # [rows][new]: this step's tokens of each row ([] for a row that has finished)
    logprobs: list[list[float]]  # [rows][new]: the sampler's log-prob of each


class DecodeListener(Protocol):
    """Told a ``generate`` call's tokens while the engine decodes them (``StreamsTokens``), in the engine's thread."""

    def on_step(self, step: DecodeStep) -> None:
        """One step's new tokens. Return quickly: the decode loop waits for it."""
        ...

    def wants_stop(self) -> bool:
        """Checked at each step boundary after the first token: True ends the call there, every row with the tokens
        it has (finish reason ``length``), as a passed deadline does (``StopsAtDeadline``)."""
        ...


@runtime_checkable
class StreamsTokens(Protocol):
    """An engine that tells each decode step's tokens as it samples them (the transformers engine); the OpenAI
    endpoint streams them as they come. Other engines (vLLM, a pool of Ray replicas) answer whole."""

    def generate_streamed(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                          listener: DecodeListener) -> list[list[Completion]]:
        """``generate``, telling ``listener`` every step's tokens; the completions are ``generate``'s (the same
        seeds give the same tokens, log-probs and versions), cut early only when ``listener.wants_stop()``."""
        ...


@runtime_checkable
class StopsAtDeadline(Protocol):
    """An engine whose ``generate`` can end early: once ``deadline`` (``time.monotonic()``) has passed, each request
    still decoding returns the tokens it has (at least one; finish reason ``length``), at the next step boundary. The
    rollout stream's budget in seconds (``partial_rollout_seconds``) uses it; a cut sample is continued next round."""

    def stop_at(self, deadline: float | None) -> None:
        """The deadline of the calls that follow (None: none)."""
        ...


@runtime_checkable
class ReceivesBroadcastWeights(Protocol):
    """An engine whose own workers take part in the weight-sync broadcast group (vLLM: each tensor-parallel worker
    is a receiver). Engines without it are fed by the process holding them (``engines/ray/actor.py`` joins the group
    for them and calls ``update_weights``). ``WeightSyncCoordinator`` (``weight_sync/coordinator.py``) drives it."""

    @property
    def num_weight_receivers(self) -> int:
        """Ranks this engine takes in the group (one per worker)."""
        ...

    def join_weight_group(self, address: Any, base_rank: int) -> list[int]:
        """Every worker joins the group at ``address`` as rank ``base_rank + its index`` (blocks until all joined)."""
        ...

    def receive_weights(self, sync_id: int) -> int:
        """Every worker receives broadcast ``sync_id`` bucket by bucket and loads it in place; returns the tensors
        loaded (the same on every worker)."""
        ...
