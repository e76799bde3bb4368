"""``ArcticBackend``: SkyRL's Tinker engine backend (``skyrl.backends.backend.AbstractBackend``) served by
an in-process ``ArcticRLClient``, so the ``tinker`` SDK trains and samples with arctic-rl (ZoRRo, its
DeepSpeed strategy, its vLLM engines and weight sync).

    python -m arctic_rl.integrations.skyrl serve --base-model Qwen/Qwen3-0.6B --port 8000 \\
        --backend-config '{"optim": {"learning_rate": 1e-6}}'

starts SkyRL's own Tinker API server and engine with backend ``arctic`` (``launch.py``). The
backend config is an ``ArcticRLClientConfig`` (``model`` defaults to ``--base-model``). Mapping:

- ``forward_backward``: Tinker's ``cross_entropy``, ``importance_sampling``, ``ppo`` and ``cispo`` run as
  arctic-rl's registered ``tinker.*`` losses (``serve/tinker/losses.py``; token sums, ratio against the
  sampler's log-probs); datums become prompt/response sequences (``serve/tinker/batch.py``). The backend
  config's ``loss_fns`` routes a ``loss_fn`` to a registered arctic-rl loss (a plugin's) instead
  (``loss_choice.py``). Metrics: ``loss:sum`` (the loss as computed), plus a registered loss's stats as ``<stat>:mean``; per-datum
  outputs are empty (call ``forward`` for log-probs).
- ``forward``: the log-prob of every target token (``logprobs``).
- ``optim_step``: arctic-rl's AdamW at the request's ``learning_rate``; betas/eps/weight decay are the
  job's (a warning says when the request asks for others).
- ``save_weights_for_sampler`` pushes the weights into the engines (and, when persisted, writes a
  ``save_pretrained`` tarball); ``sample`` samples from the engines, which hold the newest such weights.
- LoRA: ``rank=0`` trains every weight; ``rank > 0`` trains LoRA adapters of that rank (peft, the ``lora`` extra),
  or must equal ``lora.rank`` when the backend config sets it.
- Not supported (each refused with an error): more than one model, critic models, images, prompt log-probs,
  ``top_k``, stop tokens/strings, sampling an older checkpoint than the newest saved for the sampler.
"""

from __future__ import annotations

import logging
import shutil
import tarfile
import tempfile
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import arctic_rl.serve.tinker.losses  # noqa: F401  (registers the tinker.* losses in this process)
from arctic_rl.integrations.skyrl import compat
from arctic_rl.integrations.skyrl.loss_choice import LossRoute, check_routes, choose_loss
from arctic_rl.serve.tinker.batch import Datum, TinkerInputError, forward_batch, tensor_output, train_batch
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.errors import RequestError

compat.import_skyrl_types_on_python311()
from skyrl.backends.backend import AbstractBackend  # noqa: E402  (after the Python 3.11 import fix)
from skyrl.tinker import types  # noqa: E402

logger = logging.getLogger(__name__)
TORCH_ADAMW = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}  # what the job's torch.optim.AdamW uses


class ArcticBackendConfig(BaseModel):
    """SkyRL's ``--backend-config`` for backend ``arctic``: ``ArcticRLClientConfig`` fields, validated
    (every bad field named) when the backend starts the job, and ``loss_fns`` (``loss_choice.py``)."""

    model_config = ConfigDict(extra="allow")

    loss_fns: dict[str, LossRoute] = Field(
        default_factory=dict, description="A Tinker loss_fn -> the registered arctic-rl loss it runs instead, with its config.")

    def client_fields(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ArcticBackend(AbstractBackend):
    """One arctic-rl training job (one policy: full weights or LoRA) behind SkyRL's Tinker engine."""

    def __init__(self, base_model: str, config: ArcticBackendConfig):
        fields = config.client_fields()
        if fields.get("protocol", "local") != "local":
            raise ValueError("backend arctic: protocol must be 'local' (the engine process runs the training core,"
                             " where the tinker.* losses are registered)")
        fields.setdefault("model", base_model)
        if "root_dir" not in fields.get("server", {}):  # a fresh folder, left behind: set server.root_dir to choose it
            fields["server"] = {**fields.get("server", {}), "root_dir": tempfile.mkdtemp(prefix="arctic-skyrl-")}
        self.root = Path(fields["server"]["root_dir"]).resolve()  # export/save paths are made here, absolute
        fields["server"] = {**fields["server"], "root_dir": str(self.root)}
        self.client_fields = fields
        accepted = typing.get_args(types.ForwardBackwardInput.model_fields["loss_fn"].annotation)  # SkyRL's names
        check_routes(config.loss_fns, accepted)
        self.loss_fns = config.loss_fns
        self.metrics = types.EngineMetrics()
        self.client: ArcticRLClient | None = None
        self.model_id: str | None = None
        self.sampler_checkpoint: str | None = None  # checkpoint id whose weights the engines hold
        self._warned_adam: set[tuple] = set()

    # ------------------------------------------------------------------ models
    def create_model(self, model_id: str, lora_config: types.LoraConfig, model_role: str = "policy") -> None:
        configured = self.client_fields.get("lora", {}).get("rank", 0)
        if lora_config.rank != configured and configured:
            raise ValueError(f"backend arctic trains LoRA adapters of rank {configured} (its lora.rank): create the training "
                             f"client with rank={configured} (got rank={lora_config.rank})")
        if model_role != "policy":
            raise ValueError(f"backend arctic trains a policy only, got model_role={model_role!r}")
        if self.model_id is not None:
            raise ValueError(f"backend arctic holds one model ({self.model_id}); unload it before creating {model_id}")
        fields = self.client_fields  # rank > 0 with no lora.rank configured: LoRA of that rank (modules/lora.py)
        if lora_config.rank and not configured:
            fields = {**fields, "lora": {**fields.get("lora", {}), "rank": lora_config.rank}}
        client = ArcticRLClient(fields)
        try:
            client.status()  # start the job now: a bad config fails this request, not a later one
        except Exception:
            client.close()
            raise
        self.client, self.model_id, self.sampler_checkpoint = client, model_id, None

    def has_model(self, model_id: str) -> bool:
        return model_id == self.model_id

    def delete_model(self, model_id: str) -> None:
        if model_id != self.model_id:
            raise ValueError(f"backend arctic has no model {model_id}")
        self.client.close()
        self.client = self.model_id = self.sampler_checkpoint = None

    # ------------------------------------------------------------------ model passes
    def forward_backward(self, prepared_batch: types.PreparedModelPassBatch) -> dict[str, Any]:
        def run(datums: list[Datum], loss_fn: str, loss_config: dict | None) -> types.ForwardBackwardOutput:
            name, config, tinker = choose_loss(loss_fn, loss_config, self.loss_fns)
            meta = self.client.forward_backward(train_batch(datums, loss_fn, registered=not tinker), name, config)
            metrics = {"loss:sum": meta.pop("loss"), "num_tokens:sum": meta.pop("num_tokens"),
                       "num_sequences:sum": meta.pop("num_sequences")}
            if not tinker:  # the registered loss's own stats; Tinker's metric names carry their reduction
                metrics.update({f"{key.replace(':', '_')}:mean": float(value) for key, value in meta.items()
                                if isinstance(value, (int, float))})
            return types.ForwardBackwardOutput(loss_fn_output_type="scalar", loss_fn_outputs=[{} for _ in datums], metrics=metrics)

        return self._per_request(prepared_batch, run)

    def forward(self, prepared_batch: types.PreparedModelPassBatch) -> dict[str, Any]:
        def run(datums: list[Datum], loss_fn: str, loss_config: dict | None) -> types.ForwardBackwardOutput:
            logprobs = self.client.forward(forward_batch(datums), ["logprobs"])["logprobs"]
            outputs = [{"logprobs": tensor_output(logprobs[i, : len(d.targets)].tolist())} for i, d in enumerate(datums)]
            return types.ForwardBackwardOutput(loss_fn_output_type="scalar", loss_fn_outputs=outputs, metrics={})

        return self._per_request(prepared_batch, run)

    def _per_request(self, prepared: types.PreparedModelPassBatch, run) -> dict[str, Any]:
        results = {}
        for request_id, model_id, start, end in prepared.request_batch_slices:
            try:
                self._require(model_id)
                datums = [_datum(prepared, i) for i in range(start, end)]
                results[request_id] = run(datums, prepared.all_loss_fns[start], prepared.all_loss_fn_configs[start])
            except (TinkerInputError, RequestError, ValueError) as e:
                results[request_id] = types.ErrorResponse(error=str(e), status="failed")
        return results

    def _require(self, model_id: str) -> None:
        if model_id != self.model_id:
            raise ValueError(f"backend arctic has no model {model_id!r} (it holds {self.model_id!r})")

    def optim_step(self, model_id: str, request_data: types.OptimStepInput) -> types.OptimStepOutput:
        self._require(model_id)
        adam = request_data.adam_params
        asked = (adam.beta1, adam.beta2, adam.eps, adam.weight_decay)
        job = (TORCH_ADAMW["beta1"], TORCH_ADAMW["beta2"], TORCH_ADAMW["eps"],
               self.client.config.optim.weight_decay)
        if asked != job and asked not in self._warned_adam:
            self._warned_adam.add(asked)
            logger.warning("backend arctic: optim_step takes only learning_rate from the request; AdamW (beta1, beta2, eps,"
                           " weight_decay) stay the job's %s, not the request's %s", job, asked)
        meta = self.client.optim_step(lr=adam.learning_rate)
        return types.OptimStepOutput(metrics={"grad_norm": float(meta["grad_norm"]), "lr": float(meta["lr"]),
                                              "step": float(meta["step"])})

    # ------------------------------------------------------------------ sampling
    def sample(self, prepared_batch: types.PreparedSampleBatch) -> dict[str, Any]:
        """Requests are checked one by one (a refused one fails alone); those with the same ``num_samples``
        and sampling settings go to the engines in one ``client.sample`` call (vLLM batches them)."""
        results, groups = {}, {}
        for request_id, model_id, start, end, prompt_logprobs, topk in prepared_batch.request_batch_slices:
            try:
                prompt, key = self._sample_request(prepared_batch, model_id, start, end, prompt_logprobs or topk > 0)
                groups.setdefault(key, []).append((request_id, prompt, prepared_batch.all_sampling_params[start].seed))
            except (TinkerInputError, ValueError) as e:
                results[request_id] = types.ErrorResponse(error=str(e), status="failed")
        for (n, max_tokens, temperature, top_p), requests in groups.items():
            ids = [request_id for request_id, _, _ in requests]
            try:
                samples = self.client.sample([prompt for _, prompt, _ in requests], n=n, max_tokens=max_tokens,
                                             temperature=temperature, top_p=top_p, prompt_seeds=[seed for _, _, seed in requests])
            except RequestError as e:
                results.update({request_id: types.ErrorResponse(error=str(e), status="failed") for request_id in ids})
                continue
            for i, request_id in enumerate(ids):
                results[request_id] = types.SampleOutput(sequences=[
                    types.GeneratedSequence(stop_reason=reason, tokens=tokens, logprobs=lps) for tokens, lps, reason
                    in zip(samples.token_ids[i], samples.logprobs[i], samples.finish_reason[i])])
        return results

    def _sample_request(self, prepared: types.PreparedSampleBatch, model_id: str, start: int, end: int,
                        prompt_logprobs: bool) -> tuple[list[int], tuple]:
        """A sample request's prompt and its grouping key, or ``ValueError`` saying what is not supported."""
        if self.client is None:
            raise ValueError("backend arctic: create the training client first (base-model sampling needs the job running)")
        if model_id:
            self._require(model_id)
        checkpoint = prepared.all_checkpoint_ids[start] or None
        if checkpoint != self.sampler_checkpoint:
            raise ValueError(f"backend arctic samples from the weights last saved for the sampler ({self.sampler_checkpoint or 'the base model'});"
                             f" this request names {checkpoint or 'the base model'}")
        params = prepared.all_sampling_params[start]
        if prompt_logprobs:
            raise ValueError("backend arctic: prompt_logprobs / topk_prompt_logprobs are not supported")
        if params.top_k != -1 or params.stop_tokens or params.stop_strings:
            raise ValueError("backend arctic: sampling_params top_k, stop_tokens and stop_strings are not supported"
                             " (the engine stops at the tokenizer's end-of-sequence token)")
        prompt = _tokens(prepared.all_model_inputs[start], "prompt")
        return prompt, (end - start, params.max_tokens, params.temperature, params.top_p)

    # ------------------------------------------------------------------ checkpoints
    def save_sampler_checkpoint(self, output_path, model_id: str, persist: bool = True) -> None:
        self._require(model_id)
        self.client.sync_weights()
        name = _checkpoint_id(output_path)
        self.sampler_checkpoint = name
        if persist:
            exported = self.root / "sampler" / name
            self.client.export(str(exported))
            _tar(exported, output_path)

    def save_checkpoint(self, output_path, model_id: str) -> None:
        self._require(model_id)
        state = self.root / "train" / _checkpoint_id(output_path)
        state.parent.mkdir(parents=True, exist_ok=True)
        self.client.save_state(str(state))
        _tar(state, output_path)

    def load_checkpoint(self, checkpoint_path, model_id: str, load_optimizer: bool) -> None:
        self._require(model_id)
        if not load_optimizer:
            raise ValueError("backend arctic restores weights, optimizer and schedule together: load_optimizer=False is not supported")
        into = self.root / "load" / _checkpoint_id(checkpoint_path)
        shutil.rmtree(into, ignore_errors=True)
        into.mkdir(parents=True)
        with tarfile.open(_local(checkpoint_path)) as tar:
            tar.extractall(into, filter="data")
        (state,) = into.iterdir()
        self.client.load_state(str(state))
        self.sampler_checkpoint = into.name  # load_state pushed the restored weights into the engines


def _tokens(model_input: types.ModelInput, what: str) -> list[int]:
    tokens = []
    for chunk in model_input.chunks:
        if chunk.type != "encoded_text":
            raise TinkerInputError(f"{what}: {chunk.type} chunks are not supported by backend arctic (text tokens only)")
        tokens.extend(chunk.tokens)
    return tokens


def _datum(prepared: types.PreparedModelPassBatch, i: int) -> Datum:
    return Datum(tokens=_tokens(prepared.all_model_inputs[i], f"datum {i}: model_input"),
                 targets=[int(t) for t in prepared.all_targets[i]], weights=[float(w) for w in prepared.all_token_weights[i]],
                 advantages=list(prepared.all_advantages[i]), logprobs=list(prepared.all_sampling_logprobs[i]))


def _local(path) -> Path:
    if not isinstance(path, Path):
        raise ValueError(f"backend arctic writes checkpoints to local paths only, got {path}")
    return path


def _checkpoint_id(path) -> str:
    return _local(path).name.removesuffix(".tar.gz")


def _tar(source: Path, output_path) -> None:
    out = _local(output_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        tar.add(source, arcname=source.name)

