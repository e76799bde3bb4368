"""ZoRRo for gated-DeltaNet linear-attention layers (Qwen3-Next, Qwen3.5): in a packed row each prompt
runs from zero state and each response continues from its prompt's final recurrent and conv state.

A hybrid model's full-attention layers take ZoRRo's packed mask (``attention.py``). Its linear-attention
layers take no mask (transformers' ``create_recurrent_attention_mask`` drops a 4D one) and would run one
recurrence over the whole row. Their forward is position-wise except for two calls, looked up as globals
of the layer's modeling module (transformers 5.19: ``qwen3_next``, ``qwen3_5``, ``qwen3_5_moe``):

* ``causal_conv1d_fn(x [1, C, T], weight [C, K], bias, activation=...)``, a depthwise causal
  convolution: its state at the end of a prompt is the prompt's last ``K - 1`` inputs;
* ``torch_chunk_gated_delta_rule(q, k, v, g=..., beta=..., initial_state=..., output_final_state=...)``,
  the gated delta rule: its state at the end of a prompt is the ``[H, Dk, Dv]`` matrix it returns.

``install_linear_attention(model)`` wraps those two globals once; the wrappers pass every ordinary call
(generation, a naive batch) through untouched. A ZoRRo forward gives the decoder one more keyword,
``zorro_linear_segments`` (a ``LinearSegments``): transformers threads it through each decoder layer
into the linear-attention module and on into both calls, also when gradient checkpointing replays a
layer in backward. There the wrappers run the model's own functions segment by segment:

* conv: one call over an extended row in which each segment is preceded by ``K - 1`` context columns,
  zeros before a prompt and the prompt's last ``K - 1`` inputs before each of its responses;
* delta rule: one call for the prompts from zero state (``output_final_state=True``), one for the
  responses with ``initial_state`` = their prompt's final state. With transformers' torch functions,
  prompts are left-padded and responses right-padded into batches: zero ``q, k, v, g, beta`` on a left
  pad keep the zero state exactly zero, and right pads come after everything that is read. On CUDA
  with flash-linear-attention installed, its Triton ``chunk_gated_delta_rule`` takes the segments
  unpadded (``cu_seqlens``) with one initial state per segment (``ARCTIC_RL_LINEAR_KERNEL=torch``
  keeps the padded path there).

Each prompt's states receive the gradients of all its responses through autograd (the gather of its
conv tail, the ``initial_state`` input), as in the naive batch. The wrappers count their calls: a forward
in which a linear layer did not route through both is an error, never a silent whole-row recurrence.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from dataclasses import dataclass, field

import torch

from arctic_rl.patches.transformers import wrap_modeling_function
from arctic_rl.zorro.features import LINEAR, ZorroUnsupportedModel
from arctic_rl.zorro.packing import PROMPT_PARENT, PackedLayout

SEGMENTS_KWARG = "zorro_linear_segments"  # the decoder keyword that carries the layout
CONV_FN, RULE_FN = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"  # the modeling-module globals wrapped
KERNEL_ENV = "ARCTIC_RL_LINEAR_KERNEL"  # auto (fla on CUDA when installed) | fla | torch


def linear_layer_indices(model: torch.nn.Module) -> list[int]:
    """Decoder layer indices of ``model`` whose ``layer_types`` entry is ``linear_attention``."""
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    return [i for i, kind in enumerate(layer_types) if kind == LINEAR]


def install_linear_attention(model: torch.nn.Module) -> int:
    """Check that every linear-attention layer of ``model`` is a gated DeltaNet whose modeling module
    routes its sequence mixing through ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``, and
    wrap those (idempotent). Returns the number of linear-attention layers."""
    wanted = linear_layer_indices(model)
    model_type = model.config.model_type
    found = {}
    for module in model.modules():  # transformers' gated DeltaNet modules own a conv1d and their layer_idx
        index = getattr(module, "layer_idx", None)
        if index in wanted and isinstance(getattr(module, "conv1d", None), torch.nn.Conv1d):
            found[index] = module
    missing = sorted(set(wanted) - found.keys())
    if missing:
        raise ZorroUnsupportedModel(
            f"model type '{model_type}': linear-attention layers {missing} are not gated DeltaNet layers (a causal conv1d "
            "and the gated delta rule); ZoRRo carries prompt states only through those. Use the naive path (zorro: false)"
        )
    modules = {sys.modules[type(module).__module__]: type(module).__name__ for module in found.values()}
    for modeling, layer_class in modules.items():  # all checked before anything is wrapped
        missing_fns = [name for name in (CONV_FN, RULE_FN) if not callable(getattr(modeling, name, None))]
        if missing_fns:
            raise ZorroUnsupportedModel(
                f"model type '{model_type}': {modeling.__name__} has no {' / '.join(missing_fns)}; its linear-attention "
                f"layers ({layer_class}) are not gated DeltaNet layers ZoRRo can split into segments. Use the naive path "
                "(zorro: false)"
            )
    for modeling in modules:
        for name, make in ((CONV_FN, _segmented_conv), (RULE_FN, _segmented_rule)):
            wrap_modeling_function(modeling, name, make, marker="zorro_segmented")
    return len(wanted)


def _segmented_conv(original):
    """Wrap a modeling module's ``causal_conv1d_fn`` (same signature, transformers 5.19)."""

    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        segments = kwargs.pop(SEGMENTS_KWARG, None)
        if segments is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return segments.conv(original, hidden_states, weight, bias, activation)

    causal_conv1d_fn.zorro_segmented = True
    return causal_conv1d_fn


def _segmented_rule(original):
    """Wrap a modeling module's ``torch_chunk_gated_delta_rule`` (same signature, transformers 5.19)."""

    @functools.wraps(original)
    def torch_chunk_gated_delta_rule(query, key, value, *args, **kwargs):
        segments = kwargs.pop(SEGMENTS_KWARG, None)
        if segments is None:
            return original(query, key, value, *args, **kwargs)
        return segments.delta_rule(original, query, key, value, *args, **kwargs)

    torch_chunk_gated_delta_rule.zorro_segmented = True
    return torch_chunk_gated_delta_rule


def use_fla(device: torch.device) -> bool:
    """Whether the delta rule runs on flash-linear-attention's varlen kernels (``KERNEL_ENV``)."""
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in ("auto", "fla", "torch"):
        raise ValueError(f"{KERNEL_ENV} must be auto, fla or torch, got {choice!r}")
    if choice == "torch":
        return False
    available = device.type == "cuda" and importlib.util.find_spec("fla") is not None
    if choice == "fla" and not available:
        raise RuntimeError(f"{KERNEL_ENV}=fla needs CUDA tensors and flash-linear-attention installed (pip install flash-linear-attention)")
    return available


def _gather(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` along ``dim`` at ``index`` (any shape; -1 reads zeros) -> ``x``'s shape with ``dim`` replaced
    by ``index.shape``. ``index_select``: its backward adds repeated indices in a fixed order on CPU."""
    padded = torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)), x], dim)
    out = padded.index_select(dim, (index + 1).flatten())
    return out.unflatten(dim, tuple(index.shape))


@dataclass(eq=False)
class LinearSegments:
    """The segments of one packed row as the linear-attention wrappers need them. Runs are maximal
    stretches of one segment id in row order: "fresh" runs (prompts, and trailing padding) start from
    zero state, "continued" runs (responses) from the final state of their ``parent`` fresh run."""

    starts: list[int]  # row offset of each run
    lengths: list[int]  # its token count (> 0)
    parents: list[int]  # index of a response run's prompt run, -1 for fresh runs
    num_tokens: int  # row length T
    calls: dict = field(default_factory=lambda: {"conv": 0, "rule": 0})
    _cache: dict = field(default_factory=dict)

    @staticmethod
    def of(layout: PackedLayout) -> "LinearSegments":
        segment_ids, parent_ids = layout.segment_ids.cpu(), layout.parent_ids.cpu()
        t = segment_ids.shape[0]
        cut = (torch.nonzero(segment_ids[1:] != segment_ids[:-1]).flatten() + 1).tolist()
        starts = [0] + cut
        lengths = [end - start for start, end in zip(starts, cut + [t])]
        run_of_segment = {int(segment_ids[s]): r for r, s in enumerate(starts)}
        parents = [-1 if int(parent_ids[s]) == PROMPT_PARENT else run_of_segment[int(parent_ids[s])] for s in starts]
        return LinearSegments(starts, lengths, parents, t)

    def _rows(self, run: int) -> torch.Tensor:
        return torch.arange(self.starts[run], self.starts[run] + self.lengths[run])

    def _index(self, key, build, device) -> torch.Tensor:
        if (key, device) not in self._cache:
            self._cache[(key, device)] = build().to(device)
        return self._cache[(key, device)]

    @property
    def fresh_runs(self) -> list[int]:
        return [r for r, p in enumerate(self.parents) if p < 0]

    @property
    def continued_runs(self) -> list[int]:
        return [r for r, p in enumerate(self.parents) if p >= 0]

    def _conv_index(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(extended-row source rows, -1 = zero; where each row's own output sits in the extended row)."""
        source, own, offset = [], [], 0
        for run, parent in enumerate(self.parents):
            context = torch.full((width - 1,), -1, dtype=torch.long)
            if parent >= 0 and width > 1:
                tail = self._rows(parent)[-(width - 1):]
                context[width - 1 - tail.numel():] = tail
            source += [context, self._rows(run)]
            offset += width - 1
            own.append(torch.arange(offset, offset + self.lengths[run]))
            offset += self.lengths[run]
        return torch.cat(source), torch.cat(own)

    def conv(self, original, hidden_states, weight, bias, activation):
        """The model's ``causal_conv1d_fn`` over the row, segment by segment: ``[1, C, T]`` -> ``[1, C, T]``."""
        self.calls["conv"] += 1
        width = weight.shape[-1]
        indices = self._cache.get(("conv", width, hidden_states.device))
        if indices is None:
            indices = self._cache[("conv", width, hidden_states.device)] = [
                x.to(hidden_states.device) for x in self._conv_index(width)]
        source, own = indices
        out = original(_gather(hidden_states, source, -1), weight, bias, activation=activation)
        return out.index_select(-1, own)

    def _padded(self, runs: list[int], left: bool) -> torch.Tensor:
        """``[len(runs), longest]`` row indices of ``runs``, padded with -1 on the left or the right."""
        longest = max(self.lengths[r] for r in runs)
        index = torch.full((len(runs), longest), -1, dtype=torch.long)
        for i, run in enumerate(runs):
            rows = self._rows(run)
            if left:
                index[i, longest - rows.numel():] = rows
            else:
                index[i, : rows.numel()] = rows
        return index

    def delta_rule(self, original, query, key, value, g=None, beta=None, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        """The gated delta rule over the row, segment by segment, with the model's signature
        (``q/k [1, T, H, Dk]``, ``v [1, T, H, Dv]``, ``g/beta [1, T, H]``) -> ``(out [1, T, H, Dv], None)``."""
        if initial_state is not None or output_final_state or cu_seqlens is not None:
            raise RuntimeError("a ZoRRo forward runs without a cache and with its own segments (no initial_state, "
                               "final state or cu_seqlens from the caller)")
        self.calls["rule"] += 1
        inputs = (query, key, value, g, beta)
        if use_fla(query.device):
            out = self._rule_varlen(inputs, use_qk_l2norm_in_kernel)
        else:
            out = self._rule_padded(original, inputs, use_qk_l2norm_in_kernel, kwargs)
        return out, None

    def _rule_padded(self, original, inputs, l2norm: bool, kwargs) -> torch.Tensor:
        """Two calls of the model's own function: prompts left-padded, responses right-padded."""
        device = inputs[0].device
        fresh, continued = self.fresh_runs, self.continued_runs
        fresh_index = self._index("fresh-left", lambda: self._padded(fresh, left=True), device)
        q, k, v, g, b = (_gather(x[0], fresh_index, 0) for x in inputs)
        out_fresh, state = original(q, k, v, g=g, beta=b, initial_state=None, output_final_state=True,
                                    use_qk_l2norm_in_kernel=l2norm, **kwargs)
        rows, values = [fresh_index[fresh_index >= 0]], [out_fresh[fresh_index >= 0]]
        if continued:
            index = self._index("continued-right", lambda: self._padded(continued, left=False), device)
            parent = self._index("parent", lambda: torch.tensor([fresh.index(self.parents[r]) for r in continued]), device)
            q, k, v, g, b = (_gather(x[0], index, 0) for x in inputs)
            out_continued, _ = original(q, k, v, g=g, beta=b, initial_state=state.index_select(0, parent),
                                        output_final_state=False, use_qk_l2norm_in_kernel=l2norm, **kwargs)
            rows.append(index[index >= 0])
            values.append(out_continued[index >= 0])
        return self._scatter(torch.cat(rows), torch.cat(values))

    def _rule_varlen(self, inputs, l2norm: bool) -> torch.Tensor:
        """flash-linear-attention's ``chunk_gated_delta_rule`` on unpadded segments (``cu_seqlens``),
        prompts from zero state, responses from their prompt's final state (CUDA only)."""
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        device = inputs[0].device
        fresh, continued = self.fresh_runs, self.continued_runs

        def run(runs, initial_state):
            index = self._index(("rows", tuple(runs)), lambda: torch.cat([self._rows(r) for r in runs]), device)
            cu = self._index(("cu", tuple(runs)), lambda: torch.tensor([0] + [self.lengths[r] for r in runs]).cumsum(0), device)
            q, k, v, g, b = (x.index_select(1, index) for x in inputs)
            out, final = chunk_gated_delta_rule(q, k, v, g=g, beta=b, initial_state=initial_state,
                                                output_final_state=initial_state is None,
                                                use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)
            return index, out[0], final

        rows, out, state = run(fresh, None)
        if not continued:
            return self._scatter(rows, out)
        parent = self._index("parent", lambda: torch.tensor([fresh.index(self.parents[r]) for r in continued]), device)
        rows_c, out_c, _ = run(continued, state.index_select(0, parent))
        return self._scatter(torch.cat([rows, rows_c]), torch.cat([out, out_c]))

    def _scatter(self, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``[1, T, ...]`` with ``values`` at ``rows`` (every row is covered: fresh and continued runs tile the row)."""
        return values.new_zeros(self.num_tokens, *values.shape[1:]).index_copy(0, rows, values)[None]

    def check_calls(self, expected: int, model_type: str) -> None:
        """Every linear-attention layer ran both segmented calls once in this forward."""
        if self.calls != {"conv": expected, "rule": expected}:
            raise ZorroUnsupportedModel(
                f"model type '{model_type}': of {expected} linear-attention layers, {self.calls['conv']} routed their "
                f"convolution and {self.calls['rule']} their delta rule through ZoRRo's segments; the others would run "
                "the packed row as one sequence"
            )
