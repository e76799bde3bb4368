"""Batched decoding for the transformers engine: every prompt of a call in one batch, each prompt prefilled
once for its ``n`` samples, finished rows compacted away, and on CUDA each decode step replayed as one CUDA
graph. Built on the model's own forward (its attention kernels through SDPA); what is ours is the KV layout.

Layout: the prompts are left-padded to one length ``Lp``, so all rows write the same cache position at each
step and a row's padding is masked out. The KV cache is ``[rows, kv_heads, Lp + max_tokens, head_dim]`` per
layer (:class:`SlotCache`, a transformers ``Cache``). A prompt's KV is computed once and copied into its ``n``
rows. Each decode step attends over a window of the cache that grows in chunks, not over its full length.

Across calls: the buffers and the CUDA graphs outlive a call (:class:`_Arena`). On CUDA a call's rows are padded to a
power of two (the padding rows start finished) and its prompts left-padded to a multiple of ``prompt_bucket`` tokens, so batch
sizes and attention windows repeat from call to call and a graph captured once is replayed by every later call that
fits the arena (the rollout stream's rounds are many short calls). A call that does not fit grows the arena and starts
its graphs anew; ``BatchedDecoder.drop_arena`` (the engine's ``sleep``) frees it.

Finished rows: every ``check_every`` steps the loop counts the live rows; when they fit in half the batch,
they are moved to the front (a gather of every per-row tensor) and decoding continues on the smaller batch
(power-of-two sizes). So a long tail of responses costs decode steps of a small batch, not of the whole one.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from arctic_rl.rollout.engines.base import DecodeStep
from arctic_rl.rollout.engines.transformers.sampling import sample_tokens
from arctic_rl.router_replay import NOT_ROUTED, ROUTING_DTYPE, recording


class SlotCache(Cache):
    """Preallocated KV of ``rows`` sequences; ``view(rows, window)`` is the same storage seen as the first
    ``rows`` rows and ``window`` positions. ``update`` writes the one new token at ``write_at`` (a 0-d device
    tensor, so a CUDA graph replays it at the current position) and returns the window."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], write_at: torch.Tensor) -> None:
        super().__init__(layers=[])
        self.keys, self.values, self.write_at = keys, values, write_at

    @classmethod
    def allocate(cls, num_layers: int, rows: int, heads: int, length: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> SlotCache:
        def new() -> list[torch.Tensor]:
            return [torch.zeros(rows, heads, length, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

        return cls(new(), new(), torch.zeros((), dtype=torch.long, device=device))

    def view(self, rows: int, window: int) -> SlotCache:
        return SlotCache([k[:rows, :, :window] for k in self.keys], [v[:rows, :, :window] for v in self.values], self.write_at)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        at = self.write_at.view(1)
        self.keys[layer_idx].index_copy_(2, at, key_states)
        self.values[layer_idx].index_copy_(2, at, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[2]

    def gather_rows(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``index[i]`` for ``i < len(index)`` (compaction)."""
        for tensors in (self.keys, self.values):
            for t in tensors:
                t[: len(index)] = t.index_select(0, index)


class _RecordingCache(Cache):
    """Prefill's cache: keeps each layer's keys and values as computed and attends over exactly them."""

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.kv[layer_idx] = (key_states, value_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


@dataclass
class Decoded:
    """Per row (prompt ``i``'s sample ``k`` is row ``i * n + k``): generated tokens ``[rows, max_tokens]``
    (meaningful up to the first EOS), their log-probs, and how many decode steps ran."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    steps: int
    graphs: int = 0  # CUDA graphs captured by this call (one per batch size and attention window not met before)
    capture_s: float = 0.0  # host seconds spent warming up and capturing them
    token_versions: list[int] | None = None  # with a ``checkpoint``: the weights' version behind token ``t`` of every row
    # with ``routing``: the experts each MoE layer chose for token ``t`` of row ``r`` as an input ([rows, max_tokens, M, k];
    # NOT_ROUTED for a token never fed back, as a row's last), and for each prompt's tokens ([P_i, M, k] per prompt)
    routing: torch.Tensor | None = None
    prompt_routing: list[torch.Tensor] | None = None


class BatchedDecoder:
    """Decodes ``n`` samples of each of a call's prompts in one batch (see the module docstring).

    Args:
        model: a causal LM whose layers are all full attention, loaded with ``attention.NAME`` (or "sdpa").
        eos_id: the stop token. pad_id: what fills left padding (masked out).
        cuda_graphs: replay decode steps as CUDA graphs (only on a CUDA device).
        prefill_tokens: prompts are prefilled in chunks of about this many (padded) tokens.
    """

    def __init__(self, model, eos_id: int, pad_id: int, cuda_graphs: bool = True, prefill_tokens: int = 32768,
                 check_every: int = 8, min_rows: int = 8, prompt_bucket: int = 64) -> None:
        self.model, self.eos_id, self.pad_id = model, eos_id, pad_id
        self.device = next(model.parameters()).device
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.prefill_tokens, self.check_every, self.min_rows, self.prompt_bucket = prefill_tokens, check_every, min_rows, prompt_bucket
        self.arena: _Arena | None = None
        self._lock = threading.RLock()  # drop_arena runs inside a call too (arena_for grows it)
        text = model.config.get_text_config()
        self.num_layers = text.num_hidden_layers
        self.kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], n: int, max_tokens: int, uniforms: torch.Tensor, temperature: float,
               top_p: float, stop_token_ids: tuple[int, ...] = (), checkpoint: Callable[[], int] | None = None,
               expired: Callable[[], bool] | None = None, routing: tuple[int, int] | None = None,
               on_step: Callable[[DecodeStep], None] | None = None) -> Decoded:
        """Sample ``n`` continuations of at most ``max_tokens`` tokens for every prompt; row ``r`` draws its
        ``t``-th token with ``uniforms[r, t]``. A row is finished at EOS or at any of ``stop_token_ids``.
        ``checkpoint`` (``in_flight.PauseGate.checkpoint``) runs before the prefill and before each decode step (new
        weights may load there) and returns the version of the weights that step samples with. ``expired``: checked at
        each step boundary after the first token; True ends the call there, every row with the tokens it has.
        ``routing`` ``(moe_layers, top_k)``: record the experts the model's hooked routers (``router_replay.py``) choose
        for every prompt and generated token (``Decoded.routing``). ``on_step``: told each step's new token of every
        row that has not finished (a host sync per step), so a caller can stream them (``StreamsTokens``)."""
        with self._lock:  # one call at a time: the calls share the arena
            run = _Run(self, prompts, n, max_tokens, uniforms.to(self.device), temperature, top_p, stop_token_ids, checkpoint,
                       expired, routing, on_step)
            try:
                return run.go()
            finally:
                run.release()

    def arena_for(self, rows: int, length: int, max_tokens: int) -> _Arena:
        """The arena, grown (its graphs dropped) when a call needs more rows, positions or tokens than it holds."""
        arena = self.arena
        if arena is None or rows > arena.rows or length > arena.length or max_tokens > arena.max_tokens:
            old = (0, 0, 0) if arena is None else (arena.rows, arena.length, arena.max_tokens)
            self.drop_arena()
            self.arena = arena = _Arena(self, max(rows, old[0]), max(length, old[1]), max(max_tokens, old[2]))
        return arena

    def drop_arena(self) -> None:
        """Free the buffers and CUDA graphs kept between calls (after the call in flight, if any)."""
        with self._lock:
            if self.arena is not None:
                self.arena.graphs.clear()
                self.arena = None


class _Arena:
    """Buffers of up to ``rows`` rows, ``length`` cache positions and ``max_tokens`` new tokens, and the CUDA graphs
    captured over them, kept from one call to the next. A graph reads and writes only these tensors (views of them at
    the same offsets), so it stays valid for any later call that uses the same batch size and window."""

    def __init__(self, dec: BatchedDecoder, rows: int, length: int, max_tokens: int) -> None:
        self.rows, self.length, self.max_tokens = rows, length, max_tokens
        device, long = dec.device, dict(dtype=torch.long, device=dec.device)
        dtype = next(dec.model.parameters()).dtype
        self.cache = SlotCache.allocate(dec.num_layers, rows, dec.kv_heads, length, dec.head_dim, dtype, device)
        self.rowwise = {
            "mask": torch.zeros(rows, 1, 1, length, dtype=torch.bool, device=device),
            "token": torch.zeros(rows, **long),
            "position": torch.zeros(rows, **long),
            "uniforms": torch.zeros(rows, max_tokens, dtype=torch.float32, device=device),
            "out_tokens": torch.full((rows, max_tokens), dec.pad_id, **long),
            "out_logprobs": torch.zeros(rows, max_tokens, dtype=torch.float32, device=device),
            "done": torch.zeros(rows, dtype=torch.bool, device=device),
            "row_id": torch.arange(rows, **long),
        }
        self.t = torch.zeros((), **long)  # index of the token the next step samples
        self.result_tokens = torch.full((rows, max_tokens), dec.pad_id, **long)
        self.result_logprobs = torch.zeros(rows, max_tokens, dtype=torch.float32, device=device)
        self.stop_ids: dict[tuple[int, ...], torch.Tensor] = {}  # one tensor per stop set (a graph reads its address)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # (live, window, temperature, top_p, stop ids)
        self.pool = torch.cuda.graph_pool_handle() if dec.cuda_graphs else None
        self.side = torch.cuda.Stream(device) if dec.cuda_graphs else None  # warm-up and capture stream
        self.result_routing: torch.Tensor | None = None

    def keep_routing(self, layers: int, top_k: int) -> None:
        """Add the per-row routing buffer (``[rows, max_tokens, layers, top_k]``, gathered with the rows) once."""
        if "out_routing" not in self.rowwise:
            shape = (self.rows, self.max_tokens, layers, top_k)
            device = self.rowwise["token"].device
            self.rowwise["out_routing"] = torch.full(shape, NOT_ROUTED, dtype=ROUTING_DTYPE, device=device)
            self.result_routing = torch.full(shape, NOT_ROUTED, dtype=ROUTING_DTYPE, device=device)

    def start(self, rows: int, max_tokens: int, uniforms: torch.Tensor, pad_id: int) -> None:
        """Reset the per-row state of the first ``rows`` rows for a call (rows past the call's own start finished)."""
        r = self.rowwise
        r["mask"][:rows].zero_()
        r["token"][:rows].zero_()
        r["position"][:rows].zero_()
        r["uniforms"][:rows].zero_()
        r["uniforms"][: uniforms.shape[0], :max_tokens].copy_(uniforms)
        r["out_tokens"][:rows].fill_(pad_id)
        r["out_logprobs"][:rows].zero_()
        r["done"][:rows].zero_()
        r["done"][uniforms.shape[0] : rows] = True
        r["row_id"].copy_(torch.arange(self.rows, device=r["row_id"].device))
        if "out_routing" in r:
            r["out_routing"][:rows].fill_(NOT_ROUTED)
            self.result_routing[:rows].fill_(NOT_ROUTED)
        self.t.zero_()
        self.result_tokens[:rows].fill_(pad_id)
        self.result_logprobs[:rows].zero_()


class _Run:
    """One ``decode`` call's buffers and loop. Per-row state lives in ``self.rowwise`` so compaction
    gathers all of it at once."""

    def __init__(self, dec: BatchedDecoder, prompts: list[list[int]], n: int, max_tokens: int, uniforms: torch.Tensor,
                 temperature: float, top_p: float, stop_token_ids: tuple[int, ...] = (),
                 checkpoint: Callable[[], int] | None = None, expired: Callable[[], bool] | None = None,
                 routing: tuple[int, int] | None = None, on_step: Callable[[DecodeStep], None] | None = None) -> None:
        self.dec, self.n, self.max_tokens, self.expired, self.routing = dec, n, max_tokens, expired, routing
        self.on_step = on_step
        self.checkpoint, self.versions = checkpoint, ([] if checkpoint is not None else None)
        stops = tuple(sorted({dec.eos_id, *stop_token_ids}))
        self.temperature, self.top_p = temperature, top_p
        self.rows = len(prompts) * n  # the call's own rows; on CUDA padded to a power of two with finished rows
        longest = max(len(p) for p in prompts)
        if dec.device.type == "cuda":  # shapes that repeat from call to call, so graphs do (on a CPU: no padding work)
            self.padded_rows = max(dec.min_rows, 1 << max(0, math.ceil(math.log2(self.rows))))
            self.prompt_len = math.ceil(longest / dec.prompt_bucket) * dec.prompt_bucket
        else:
            self.padded_rows, self.prompt_len = self.rows, longest
        self.length = self.prompt_len + max_tokens
        self.window_chunk = max(64, 1 << max(0, math.ceil(math.log2(max(1, max_tokens) / 4))))  # max_tokens 1-3 too
        self.arena = arena = dec.arena_for(self.padded_rows, self.length, max_tokens)
        if routing is not None:
            arena.keep_routing(*routing)
        arena.start(self.padded_rows, max_tokens, uniforms, dec.pad_id)
        self.stop_ids = arena.stop_ids.setdefault(stops, torch.tensor(stops, dtype=torch.long, device=dec.device))
        self.graph_key = (temperature, top_p, stops, routing is not None)  # a recording step writes the routing buffer
        self.cache, self.rowwise, self.t = arena.cache, arena.rowwise, arena.t
        self.result_tokens, self.result_logprobs = arena.result_tokens, arena.result_logprobs
        self.graphs, self.pool, self.side = arena.graphs, arena.pool, arena.side
        self.captured, self.capture_s = 0, 0.0
        self.prompts = prompts
        self.prompt_routing: list[torch.Tensor] = []
        self.stops, self.told_finished = set(stops), [False] * self.rows  # ``on_step``: rows whose stop token was told

    def go(self) -> Decoded:
        self._version()
        self._prefill()
        self._tell(self.padded_rows)
        live, steps = self.padded_rows, 1
        while steps < self.max_tokens:
            if steps % self.dec.check_every == 0:
                live = self._compact(live)
                if live == 0:
                    break
            self._version()
            if self.expired is not None and self.expired():
                break  # every row holds its first token (the prefill's) at least
            self._step(live, self._window(steps))
            self._tell(live)
            steps += 1
        self._save(live)
        rows, tokens = self.rows, self.max_tokens
        routing = None if self.routing is None else self.arena.result_routing[:rows, :tokens].clone()
        return Decoded(self.result_tokens[:rows, :tokens].clone(), self.result_logprobs[:rows, :tokens].clone(), steps,
                       self.captured, self.capture_s, self.versions, routing, self.prompt_routing if self.routing else None)

    def _version(self) -> None:
        """At a step boundary: let an in-flight weight update in, and note the version the next token samples with."""
        if self.checkpoint is not None:
            self.versions.append(self.checkpoint())

    def _tell(self, live: int) -> None:
        """``on_step``: the token each of the first ``live`` rows just sampled, by original row; a row is told up to and
        including its first stop token (what ``generate`` keeps of it), nothing after."""
        if self.on_step is None:
            return
        r, t = self.rowwise, int(self.t) - 1  # the step wrote token ``t - 1`` of every row
        token_ids: list[list[int]] = [[] for _ in range(self.rows)]
        logprobs: list[list[float]] = [[] for _ in range(self.rows)]
        for row, token, logprob in zip(r["row_id"][:live].tolist(), r["out_tokens"][:live, t].tolist(),
                                       r["out_logprobs"][:live, t].tolist()):
            if row < self.rows and not self.told_finished[row]:  # (rows past ``self.rows``: CUDA's padding rows)
                token_ids[row], logprobs[row] = [token], [logprob]
                self.told_finished[row] = token in self.stops
        if any(token_ids):  # (steps between the last row's stop and the check that ends the loop add nothing)
            self.on_step(DecodeStep(token_ids, logprobs))

    def _window(self, steps: int) -> int:
        """Cache positions a step attends over: the prompt and the generated tokens so far, rounded up."""
        generated = math.ceil((steps + 1) / self.window_chunk) * self.window_chunk
        return min(self.length, self.prompt_len + generated)

    def _prefill(self) -> None:
        """Each prompt once, left-padded to ``prompt_len``, in chunks; its KV copied to its ``n`` rows, and
        each row's first token sampled from the prompt's last logits."""
        dec, lp, r = self.dec, self.prompt_len, self.rowwise
        per_chunk = max(1, dec.prefill_tokens // lp)
        for start in range(0, len(self.prompts), per_chunk):
            chunk = self.prompts[start : start + per_chunk]
            ids = torch.tensor([[dec.pad_id] * (lp - len(p)) + p for p in chunk], device=dec.device)
            valid = torch.tensor([[False] * (lp - len(p)) + [True] * len(p) for p in chunk], device=dec.device)
            causal = torch.ones(lp, lp, dtype=torch.bool, device=dec.device).tril()
            mask = (causal & valid[:, None, :]) | torch.eye(lp, dtype=torch.bool, device=dec.device)  # pads see themselves: no NaN rows
            positions = (valid.long().cumsum(-1) - 1).clamp_(min=0)
            recorder = _RecordingCache()
            with self._recording_prompts(chunk, lp):
                out = dec.model(input_ids=ids, position_ids=positions, attention_mask=mask[:, None], past_key_values=recorder,
                                use_cache=True, logits_to_keep=1)
            rows = slice(start * self.n, (start + len(chunk)) * self.n)
            for layer, (k, v) in recorder.kv.items():
                self.cache.keys[layer][rows, :, :lp] = k.repeat_interleave(self.n, 0)
                self.cache.values[layer][rows, :, :lp] = v.repeat_interleave(self.n, 0)
            r["mask"][rows, 0, 0, :lp] = valid.repeat_interleave(self.n, 0)
            r["position"][rows] = (positions[:, -1] + 1).repeat_interleave(self.n, 0)
            logits = out.logits[:, -1].repeat_interleave(self.n, 0)
            self._take(logits, rows)
        self.cache.write_at.fill_(lp)
        self.t.fill_(1)

    def _recording_prompts(self, chunk: list[list[int]], lp: int):
        """With ``routing``: the prefill's router choices, each prompt's own tokens (not its left padding), kept."""
        if self.routing is None:
            return contextlib.nullcontext()
        kept = torch.full((len(chunk), lp, *self.routing), NOT_ROUTED, dtype=ROUTING_DTYPE, device=self.dec.device)
        self.prompt_routing += [kept[i, lp - len(p):] for i, p in enumerate(chunk)]

        def sink(layer: int, indices: torch.Tensor) -> None:
            kept[:, :, layer] = indices.view(len(chunk), lp, -1)

        return recording(sink)

    def _recording_step(self, live: int):
        """With ``routing``: a decode step's router choices, written at the fed token's index (``t - 1``) of each row
        (device ops only, so a CUDA graph replays them)."""
        if self.routing is None:
            return contextlib.nullcontext()
        out = self.rowwise["out_routing"]

        def sink(layer: int, indices: torch.Tensor) -> None:
            out[:live, :, layer].index_copy_(1, (self.t - 1).view(1), indices.view(live, 1, -1).to(ROUTING_DTYPE))

        return recording(sink)

    def _take(self, logits: torch.Tensor, rows) -> None:
        """Sample token ``t`` (a device scalar) of ``rows`` from ``logits`` and record it."""
        r = self.rowwise
        t = self.t.expand(logits.shape[0], 1)
        token, logprob = sample_tokens(logits, r["uniforms"][rows].gather(1, t).squeeze(1), self.temperature, self.top_p)
        r["out_tokens"][rows].scatter_(1, t, token[:, None])
        r["out_logprobs"][rows].scatter_(1, t, logprob[:, None])
        r["done"][rows] |= torch.isin(token, self.stop_ids)
        r["token"][rows] = token

    def _decode_step(self, live: int, window: int) -> None:
        """One token for the first ``live`` rows, attending over ``window`` cache positions. No host sync:
        everything it reads and writes is a device tensor, so it can be captured as a CUDA graph."""
        r = self.rowwise
        mask = r["mask"][:live, :, :, :window]
        mask.index_fill_(3, self.cache.write_at.view(1), True)
        with self._recording_step(live):
            out = self.dec.model(input_ids=r["token"][:live, None], position_ids=r["position"][:live, None], attention_mask=mask,
                                 past_key_values=self.cache.view(live, window), use_cache=True)
        self._take(out.logits[:, -1], slice(0, live))
        r["position"][:live] += 1
        self.cache.write_at += 1
        self.t += 1

    def _step(self, live: int, window: int) -> None:
        if not self.dec.cuda_graphs:
            self._decode_step(live, window)
            return
        key = (live, window, *self.graph_key)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        started = time.perf_counter()
        self.side.wait_stream(torch.cuda.current_stream())  # this shape's first step runs eagerly (warm-up),
        with torch.cuda.stream(self.side):  # then is captured for the next ones
            self._decode_step(live, window)
        torch.cuda.current_stream().wait_stream(self.side)
        graph = torch.cuda.CUDAGraph()
        saved = (self.cache.write_at.clone(), self.t.clone())
        # capture_begin/end, not torch.cuda.graph: that one empties the allocator's cache (and collects garbage) on every
        # capture. thread_local: training may run its own CUDA work in another thread meanwhile (the rollout stream's
        # rounds and the look-ahead generate beside it); only this thread's unsafe calls would break the capture.
        with torch.cuda.stream(self.side):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                self._decode_step(live, window)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self.side)
        self.cache.write_at.copy_(saved[0])  # capture records, it does not run; the counters are left as they were
        self.t.copy_(saved[1])
        self.graphs[key] = graph
        self.captured += 1
        self.capture_s += time.perf_counter() - started

    def _compact(self, live: int) -> int:
        """Count the live rows (a host sync); when they fit in half the batch, gather them to the front."""
        r = self.rowwise
        alive = (~r["done"][:live]).nonzero().squeeze(1)
        count = alive.numel()
        target = max(self.dec.min_rows, 1 << max(0, math.ceil(math.log2(max(count, 1)))))
        if count == 0:  # every row finished: keep their outputs (the loop ends, nothing else saves them)
            self._save(live)
            return 0
        if target > live // 2:
            return live
        self._save(live)
        finished = r["done"][:live].nonzero().squeeze(1)[: target - count]  # fill to a power of two with finished rows
        index = torch.cat([alive, finished])
        for tensor in r.values():
            tensor[:target] = tensor.index_select(0, index)
        self.cache.gather_rows(index)
        return target

    def _save(self, live: int) -> None:
        """Copy the first ``live`` rows' outputs to the result, by original row."""
        r = self.rowwise
        self.result_tokens.index_copy_(0, r["row_id"][:live], r["out_tokens"][:live])
        self.result_logprobs.index_copy_(0, r["row_id"][:live], r["out_logprobs"][:live])
        if self.routing is not None:
            self.arena.result_routing.index_copy_(0, r["row_id"][:live], r["out_routing"][:live])

    def release(self) -> None:
        """Let go of the arena (the decoder keeps it for the next call)."""
        self.arena = self.cache = self.rowwise = self.side = self.graphs = None
