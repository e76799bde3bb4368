"""``Operations``: the service's operations as one contract, implemented by the one-process core (``ServiceCore``),
the several-rank front (``RankedCore``) and the client (``ArcticRLClient``); ``ops.CoreHandler`` dispatches a
request by these method names (``OPERATIONS``), so a new operation is declared here once and every implementation
that misses it fails when its class is defined.

Every operation takes ``timeout_s`` (None: ``timeouts.call_s``) and raises a ``serve.errors.ServiceError`` subclass on
failure: ``RequestError`` for a bad argument (the operation did not run), ``ServiceTimeout`` past ``timeout_s``,
``JobFailed`` once the training job has ended (every later call raises it too). A request id (``request_id``, at
most 128 characters) makes a retry safe: the same id again answers the first call's result with ``replayed: True``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

LIFECYCLE = ("close",)  # abstract, but not an operation a request can name


class Operations(ABC):
    """The contract. A subclass that implements only part of it says so with ``abstract=True``
    (``class PathOperations(Operations, abstract=True)``); any other subclass must define every operation, or its
    class statement raises ``TypeError`` naming the missing ones."""

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if abstract:
            return
        own = vars(Operations)
        missing = [name for name in OPERATIONS + LIFECYCLE
                   if next(vars(k)[name] for k in cls.__mro__ if name in vars(k)) is own[name]]
        if missing:
            raise TypeError(f"{cls.__name__} implements Operations but not {', '.join(missing)}; define "
                            f"{'it' if len(missing) == 1 else 'them'}, or declare the class with abstract=True")

    @abstractmethod
    def sample(self, prompts: list[list[int]] | list[str], n: int = 1, max_tokens: int | None = None,
               temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
               prompt_seeds: list[int] | None = None, timeout_s: float | None = None,
               stop_token_ids: list[int] = (), max_staleness: int | None = None, listener: Any = None) -> Any:
        """``n`` completions of each prompt with the engines' current weights; a completion ends at
        end-of-sequence, at one of ``stop_token_ids`` (kept) or after ``max_tokens``.

        Args:
            prompts: token ids, or strings tokenized as they are (no chat template); not empty.
            n: completions per prompt, >= 1. ``max_tokens``: per completion (None: ``sampling.max_response_length``).
            temperature: >= 0 (0: greedy). ``top_p``: in (0, 1].
            seed, prompt_seeds: each completion of prompt ``i`` draws from its own stream, derived from
                ``prompt_seeds[i]`` (one per prompt) or from ``seed`` and ``i``.
            max_staleness: None: the engines' weights as they are (``sync_weights`` moves them). ``k >= 0``: if the
                engines are more than ``k`` optimizer steps behind the trainer, push its weights first (``lag.py``;
                ``status`` says how far behind they are: ``weights_behind``).
            listener: a ``DecodeListener`` (``rollout/engines/base.py``) told each decode step's tokens while the
                engine samples them, and asked at each step whether to stop early. Only the one-process core over an
                in-process engine that ``StreamsTokens`` (the transformers engine) calls it; the others (vLLM, Ray
                replicas, ranks in other processes, the HTTP client) never do, and answer whole as without it.
        Returns:
            the prompts as token ids and, per prompt, ``n`` completions: token ids, log-probs, text, finish reason
            and the weight version that sampled it (0: the start-up weights; ``k``: after the ``k``-th
            ``sync_weights``) (the cores: ``core.SampleOutput``; the client: ``client.Samples``).
        Raises:
            RequestError: a bad argument, or more tokens than ``server.max_sample_tokens_per_request``.
        """

    @abstractmethod
    def forward(self, batch: Any, processors: list[str] = ("logprobs",), timeout_s: float | None = None) -> Any:
        """Per-token outputs of ``batch`` (a ``TrainBatch``) under the policy, without gradients.

        Args:
            processors: registered post-forward processors by name (``logprobs``, ``entropy``, ``ref_logprobs``,
                a plugin's), not empty.
        Returns:
            one tensor per processor output, by name (a ``dict[str, torch.Tensor]``).
        Raises:
            RequestError: an unknown processor, or a batch whose shapes or token ids do not fit the model.
        """

    @abstractmethod
    def forward_backward(self, batch: Any, loss: str, loss_config: dict[str, Any] | None = None,
                         timeout_s: float | None = None, request_id: str | None = None,
                         processors: list[str] = ()) -> dict[str, Any]:
        """The loss of ``batch`` (a ``TrainBatch`` with advantages); its gradients accumulate until ``optim_step``.

        Args:
            loss: a name in the loss registry (``loss_registry.py``). ``loss_config``: that loss's options.
            request_id: a retry with the same id answers the first call's result and accumulates nothing.
            processors: post-forward processors, as ``forward`` takes them, run on the loss's own forward (the
                log-probs that took the gradient; no second pass).
        Returns:
            ``loss`` and the loss's metrics (``replayed: True`` for a replay); with ``processors``, also ``outputs``:
            their tensors by name, as ``forward`` returns them.
        Raises:
            RequestError: an unknown loss or option, or an id reused for another batch.
        """

    @abstractmethod
    def optim_step(self, lr: float | None = None, timeout_s: float | None = None, request_id: str | None = None,
                   advance_schedule: bool = True, adam: Any = None) -> dict[str, float]:
        """Clip, step the optimizer, zero the gradients.

        Args:
            lr: this step's rate, finite and > 0 (None: the schedule's). ``advance_schedule=False``: the schedule
                stays where it is. ``adam``: this step's other AdamW settings (beta1, beta2, eps, weight_decay,
                max_grad_norm; the cores take ``batch.AdamSettings``, the client a dict), kept for later steps.
        Returns:
            ``grad_norm`` (before clipping), ``lr``, ``step``; ``step_skipped`` when the gradient was not finite.
        Raises:
            RequestError: ``lr`` or an ``adam`` field out of range.
        """

    @abstractmethod
    def zero_grad(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Drop the accumulated gradients. Returns the job's step."""

    @abstractmethod
    def sync_weights(self, timeout_s: float | None = None) -> dict[str, float]:
        """Push the policy's weights into the sampling engines. Returns the sync's timings and the engines' new
        ``weight_version``."""

    @abstractmethod
    def sleep(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Free the engines' accelerator memory (colocated engines; a no-op on CPU)."""

    @abstractmethod
    def wake(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Take the memory ``sleep`` freed back."""

    @abstractmethod
    def save_state(self, path: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Weights, optimizer, schedule and step under ``path`` (relative to ``server.root_dir``), for an exact
        ``load_state``. Returns ``path`` as given. Raises ``RequestError`` for a path outside ``server.root_dir``
        or one that holds something else."""

    @abstractmethod
    def load_state(self, path: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Restore a ``save_state`` from ``path`` and push the restored weights to the engines. Raises
        ``RequestError`` for a path that holds no state or one saved with another model or layout."""

    @abstractmethod
    def export(self, path: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Write the policy as a ``save_pretrained`` directory under ``path`` (relative to ``server.root_dir``)."""

    @abstractmethod
    def status(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The job's step, learning rate, model (as the server's config names it), model type, vocabulary size,
        world size, process id, and ``engine_replicas``: each engine's weight version and where it runs."""

    @abstractmethod
    def close(self) -> None:
        """End the job, or the connection to it (idempotent)."""


# the operations a request can name, in the order they are declared above
OPERATIONS = tuple(name for name in vars(Operations) if name in Operations.__abstractmethods__ and name not in LIFECYCLE)
