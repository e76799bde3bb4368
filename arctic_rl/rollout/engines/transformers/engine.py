"""A rollout engine on transformers models: the engine where vLLM is not installed, and the GPU engine where
vLLM's wheels do not match the machine's torch. Same interface as vLLM's (``engines/base.py``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from arctic_rl.errors import ConfigError
from arctic_rl.rollout.engines.base import Completion, DecodeListener, SamplingConfig
from arctic_rl.rollout.engines.in_flight import PauseGate
from arctic_rl.rollout.engines.transformers.attention import NAME as DECODE_ATTENTION
from arctic_rl.rollout.engines.transformers.decode import BatchedDecoder
from arctic_rl.rollout.engines.transformers.sampling import uniform_table
from arctic_rl.rollout.engines.seeds import request_seeds
from arctic_rl.router_replay import NOT_ROUTED, ROUTING_DTYPE, install_router_hooks, routing_shape


class TransformersEngine:
    """Holds its own copy of the model and samples with it (``decode.py``: one batch per call, each
    prompt prefilled once for its ``n`` samples, finished rows compacted away, CUDA-graph decode on a GPU).
    Models with other than full-attention layers (linear-attention or sliding-window hybrids) sample with
    the row loop below, one batch per prompt length.

    ``UpdatesInFlight``: ``update_weights`` may run in another thread while ``generate`` decodes; the loop pauses at
    its next step for the load (``in_flight.py``) and each completion says which weights sampled each token.

    ``StreamsTokens``: ``generate_streamed`` tells a listener every decode step's tokens (the batched decoder; the row
    loop of hybrid models tells none and answers whole).

    Args:
        model_path: a ``save_pretrained`` directory (model and tokenizer).
        dtype: torch dtype name for the engine's copy (``float32`` on CPU).
        device: where the engine's model lives (``cpu``, ``cuda``, ``cuda:1``).
        cuda_graphs: replay decode steps as CUDA graphs (on a CUDA device; off for debugging).
        liger: Liger's fused RMSNorm, SwiGLU and RoPE kernels in the engine's copy (``arctic_rl/liger.py``):
            ``auto`` (on with CUDA and liger-kernel installed), ``true`` or ``false``. Fewer kernels per decode step.
    """

    def __init__(self, model_path: str, dtype: str = "float32", device: str = "cpu", cuda_graphs: bool = True,
                 liger: bool | str = "auto") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype), attn_implementation=DECODE_ATTENTION)
        self.model = self.model.to(self.device).eval()
        if self.device.type == "cuda":
            from arctic_rl.liger import use_liger

            use_liger(liger, self.model)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        layer_types = getattr(self.model.config.get_text_config(), "layer_types", None) or ["full_attention"]
        self.decoder = None
        if set(layer_types) == {"full_attention"}:
            self.decoder = BatchedDecoder(self.model, self.eos_id, self.pad_id, cuda_graphs=cuda_graphs)
        self._asleep = False
        self._parameters: dict[str, torch.nn.Parameter] | None = None  # by HF name, for ``weight_target``
        self.gate = PauseGate(self._device_sync)
        self._routing: tuple[int, int] | None = None  # (MoE layers, top-k) once the routers are hooked

    def _routing_of(self, sampling: SamplingConfig) -> tuple[int, int] | None:
        """``(moe_layers, top_k)`` when ``sampling`` asks for the routing (the routers hooked on first use), else None."""
        if not sampling.return_routed_experts:
            return None
        if self.decoder is None:
            raise ConfigError("corrections.router_replay: the transformers engine records MoE routing in its batched decoder "
                              "only (models whose layers are all full attention)")
        if self._routing is None:
            install_router_hooks(self.model)
            self._routing = routing_shape(self.model)
        return self._routing

    def _device_sync(self) -> None:
        """Wait for the calling thread's queued work on the engine's device (``PauseGate``)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @property
    def weight_version(self) -> int:
        """``UpdatesInFlight``: the weight updates loaded so far (0: the start-up weights)."""
        return self.gate.version

    def stop_at(self, deadline: float | None) -> None:
        """``StopsAtDeadline``: later calls end at the first step boundary past ``deadline``."""
        self.gate.deadline = deadline

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """``sampling.n`` samples of every prompt; each sample draws from its own seeded stream (``seeds.py``),
        so what a sample is does not depend on the other prompts of the call."""
        return self._generate(prompt_token_ids, sampling, None)

    def generate_streamed(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                          listener: DecodeListener) -> list[list[Completion]]:
        """``StreamsTokens``: ``generate``, telling ``listener`` each step's tokens and ending early (at a step boundary,
        as at a deadline) once it ``wants_stop``. Hybrid models' row loop tells nothing and does not end early."""
        return self._generate(prompt_token_ids, sampling, listener)

    @torch.no_grad()
    def _generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                  listener: DecodeListener | None) -> list[list[Completion]]:
        if self._asleep:
            raise RuntimeError("TransformersEngine.generate while asleep: call wake_up() first")
        if not prompt_token_ids:
            return []
        if any(len(ids) == 0 for ids in prompt_token_ids):
            raise ValueError(f"prompt {[len(ids) for ids in prompt_token_ids].index(0)} has no tokens")
        seeds = request_seeds(sampling.seed, sampling.prompt_seeds, len(prompt_token_ids), sampling.n)
        routing = self._routing_of(sampling)
        with self.gate.decoding():
            if self.decoder is None:
                return self._generate_by_length(prompt_token_ids, sampling, seeds)
            row_seeds = None if seeds is None else [s for per_prompt in seeds for s in per_prompt]
            rows = len(prompt_token_ids) * sampling.n
            uniforms = uniform_table(row_seeds, rows, sampling.max_tokens, self.device)
            expired = self.gate.expired if listener is None else lambda: self.gate.expired() or listener.wants_stop()
            decoded = self.decoder.decode(prompt_token_ids, sampling.n, sampling.max_tokens, uniforms, sampling.temperature,
                                          sampling.top_p, sampling.stop_token_ids, checkpoint=self.gate.checkpoint,
                                          expired=expired, routing=routing,
                                          on_step=None if listener is None else listener.on_step)
        steps = decoded.steps  # fewer than max_tokens when every row stopped, or at a deadline (the rest is padding)
        flat = _completions(decoded.tokens[:, :steps].tolist(), decoded.logprobs[:, :steps].tolist(),
                            {self.eos_id, *sampling.stop_token_ids}, decoded.token_versions)
        if routing is not None:
            _attach_routing(flat, decoded, sampling.n)
        return [flat[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompt_token_ids))]

    def _generate_by_length(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                            seeds: list[list[int]] | None) -> list[list[Completion]]:
        """The row loop for hybrid models: prompts of equal length together, ``n`` rows each, no padding."""
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(prompt_token_ids):
            by_length.setdefault(len(ids), []).append(i)
        out: list[list[Completion]] = [[] for _ in prompt_token_ids]
        for same_length in by_length.values():
            rows = [prompt_token_ids[i] for i in same_length for _ in range(sampling.n)]
            generators = None if seeds is None else [self._generator(s) for i in same_length for s in seeds[i]]
            completions = self._generate_rows(rows, sampling, generators)
            for k, i in enumerate(same_length):
                out[i] = completions[k * sampling.n : (k + 1) * sampling.n]
        return out

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _generate_rows(self, rows: list[list[int]], sampling: SamplingConfig, generators: list[torch.Generator] | None) -> list[Completion]:
        """Sample one continuation of each row (all of one length), token by token with a KV cache; row
        ``k`` draws from ``generators[k]`` (its own stream) when given, else from the process's random state."""
        input_ids = torch.tensor(rows, device=self.device)
        versions = [self.gate.checkpoint()]  # per token: the weights its logits came from (``UpdatesInFlight``)
        out = self.model(input_ids=input_ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        tokens, logps = [], []
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        stop_ids = torch.tensor(sorted({self.eos_id, *sampling.stop_token_ids}), device=self.device)
        for _ in range(sampling.max_tokens):
            logprobs = torch.log_softmax(logits.float() / max(sampling.temperature, 1e-6), dim=-1)
            probs = _top_p_filter(logprobs.exp(), sampling.top_p)
            nxt = _sample(probs, generators)
            tokens.append(torch.where(done, self.pad_id, nxt))
            logps.append(logprobs.gather(-1, nxt[:, None]).squeeze(-1))
            done |= torch.isin(nxt, stop_ids)
            if done.all():
                break
            versions.append(self.gate.checkpoint())
            if self.gate.expired():
                break
            out = self.model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
        return _completions(torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist(), {self.eos_id, *sampling.stop_token_ids},
                            versions)

    @torch.no_grad()
    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        scores = []
        for ids in token_ids:
            x = torch.tensor([ids], device=self.device)
            logprobs = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), dim=-1)
            scores.append(logprobs.gather(-1, x[0, 1:, None]).squeeze(-1).tolist())
        return scores

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the tensors (a decode running in another thread pauses at its next step for it: ``UpdatesInFlight``)."""
        with self.gate.paused():
            self._load(named_tensors)

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = self.model.state_dict(keep_vars=True)  # includes tied names such as lm_head.weight
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine model has no parameter {name!r}")
            param = params[name]
            if tensor.data_ptr() == param.data_ptr() and tensor.shape == param.shape and tensor.dtype == param.dtype:
                continue  # received in place (``weight_target``): nothing to copy
            param.copy_(tensor.to(param.device, param.dtype))

    def weight_target(self, name: str) -> torch.Tensor | None:
        """``ReceivesInPlace``: the parameter's own storage (the receiver checks shape, dtype and device: a sleeping
        engine's weights are in host memory and are received into a buffer instead)."""
        if self._parameters is None:  # the Parameter objects stay the same across ``sleep``/``wake_up`` (``Module.to``)
            self._parameters = self.model.state_dict(keep_vars=True)
        param = self._parameters.get(name)
        return None if param is None else param.data

    def sleep(self) -> None:
        """Move the weights to host memory and hand the device's cached blocks back (the decoder's KV cache and CUDA
        graphs, kept between calls, are freed), so training has the accelerator to itself."""
        if self._asleep:
            return
        if self.decoder is not None:
            self.decoder.drop_arena()  # the KV cache and CUDA graphs kept between calls
        self.model.to("cpu")
        self._asleep = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self._asleep:
            self.model.to(self.device)
            self._asleep = False

    def shutdown(self) -> None:
        if self.decoder is not None:
            self.decoder.drop_arena()
        self.decoder = None
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _completions(tokens: list[list[int]], logprobs: list[list[float]], stop_ids: set[int],
                 versions: list[int] | None = None) -> list[Completion]:
    """Rows of sampled tokens cut after their first EOS or stop token ("stop"), else kept whole ("length").
    ``versions``: the weights' version behind token ``t`` of every row (``token_versions``)."""
    completions = []
    for row, lp in zip(tokens, logprobs):
        length = next((t + 1 for t, tok in enumerate(row) if tok in stop_ids), None)
        reason = "length" if length is None else "stop"
        length = length or len(row)
        own = None if versions is None else versions[:length]
        completions.append(Completion(token_ids=row[:length], logprobs=lp[:length], finish_reason=reason, token_versions=own))
    return completions


def _attach_routing(flat: list[Completion], decoded, n: int) -> None:
    """Each completion's ``routed_experts``: its prompt's routing, then its generated tokens' (on the host)."""
    prompt_routing = [p.cpu() for p in decoded.prompt_routing]
    rows = decoded.routing.cpu()
    for row, completion in enumerate(flat):
        own = rows[row, : len(completion.token_ids)].clone()
        if len(completion.token_ids):
            own[-1] = NOT_ROUTED  # never fed back: decode may have fed it after the call's last kept step, or not at all
        completion.routed_experts = torch.cat([prompt_routing[row // n], own]).to(ROUTING_DTYPE)


def _sample(probs: torch.Tensor, generators: list[torch.Generator] | None) -> torch.Tensor:
    """One token per row of ``probs`` ``[n, V]``; row ``k`` from ``generators[k]`` when given."""
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row outside the smallest set with cumulative probability >= top_p."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p > top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)
