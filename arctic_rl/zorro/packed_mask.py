"""``PackedMask``: the packed layout, its backend and each layer's ``AttentionFeatures``, handed to every
attention layer of a ZoRRo forward as one 4D marker tensor.

transformers passes any 4D tensor given as ``attention_mask`` straight to the attention function
(and activation recomputation replays the same object), which is how the layout reaches every
layer, in forward and in recomputed forwards, without new keyword arguments. Each layer asks it for
the mask of *its* window (``dense_mask`` / ``block_mask``); masks are built on first use and kept
for the other layers and passes of that forward.
"""

from __future__ import annotations

import torch

from arctic_rl.zorro.cascade import CascadePlan
from arctic_rl.zorro.features import AttentionFeatures, ZorroUnsupportedModel
from arctic_rl.zorro.masks import dense_zorro_mask, zorro_block_mask
from arctic_rl.zorro.packing import PAD_SEGMENT, PROMPT_PARENT, PackedLayout
from arctic_rl.zorro.sequence_parallel import SequenceParallel
from arctic_rl.zorro.tree_masks import dense_tree_mask, tree_block_mask

FLEX_BLOCK_SIZE = 128
PACKED_KERNELS = ("sdpa", "flex", "flash", "cudnn")  # dense reference, FlexAttention, the two cascade kernels


class PackedMask(torch.Tensor):
    """A ``[1, 1, 1, 1]`` bool marker. ``kernel``: ``sdpa`` (dense boolean masks, the CPU
    reference), ``flex`` (block masks), ``flash`` / ``cudnn`` (cascade attention over ``plan``;
    layers with features the cascade kernels lack run on flex over the same row, padded)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops on it give plain tensors, never a marker without its fields

    kernel: str
    model_type: str
    features: tuple[AttentionFeatures, ...]
    segment_ids: torch.Tensor  # [T] of the row the model sees
    parent_ids: torch.Tensor
    position_ids: torch.Tensor
    ancestors: torch.Tensor | None  # [S, D + 1] of a prefix-tree row (``tree_masks.py``), None: shared prompts
    plan: CascadePlan | None
    sequence_parallel: SequenceParallel | None  # the layer sees T/N rows and exchanges them (sequence_parallel.py)
    _masks: dict

    @staticmethod
    def of(layout: PackedLayout, kernel: str, features: tuple[AttentionFeatures, ...], model_type: str,
           plan: CascadePlan | None = None, sequence_parallel: SequenceParallel | None = None) -> "PackedMask":
        if kernel not in PACKED_KERNELS:
            raise ValueError(f"packed mask kernel must be one of {PACKED_KERNELS}, got {kernel!r}")
        if (plan is None) != (kernel in ("sdpa", "flex")):
            raise ValueError(f"kernel {kernel!r} {'needs' if plan is None else 'takes no'} cascade plan")
        if layout.ancestors is not None and kernel not in ("sdpa", "flex"):
            raise ValueError(f"prefix-tree layouts run on the sdpa or flex kernels; the {kernel!r} cascade kernels "
                             "express one shared prompt per group only")
        device = layout.input_ids.device
        mask = torch.Tensor._make_subclass(PackedMask, torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device))
        mask.kernel, mask.model_type, mask.features, mask.plan, mask._masks = kernel, model_type, features, plan, {}
        mask.segment_ids, mask.parent_ids, mask.position_ids = layout.segment_ids, layout.parent_ids, layout.position_ids
        mask.ancestors, mask.sequence_parallel = layout.ancestors, sequence_parallel
        return mask

    @property
    def num_tokens(self) -> int:
        return self.segment_ids.shape[0]

    def layer_features(self, module: torch.nn.Module) -> tuple[int, AttentionFeatures]:
        """``(layer index, features)`` of the attention ``module`` being called."""
        index = getattr(module, "layer_idx", None)  # transformers' attention modules carry their index
        if not isinstance(index, int) or not 0 <= index < len(self.features):
            if len(set(self.features)) == 1:
                return 0, self.features[0]
            raise ZorroUnsupportedModel(
                f"model type '{self.model_type}': attention module {type(module).__name__} has no usable layer_idx "
                f"({index!r}) and its layers differ ({sorted({f.describe() for f in self.features})})"
            )
        return index, self.features[index]

    def dense_mask(self, window: int | None) -> torch.Tensor:
        """``[1, 1, T, T]`` bool mask of the rule with ``window``."""
        key = ("dense", window)
        if key not in self._masks and self.ancestors is not None:
            self._masks[key] = dense_tree_mask(self.segment_ids, self.ancestors, self.position_ids, window)
        elif key not in self._masks:
            self._masks[key] = dense_zorro_mask(self.segment_ids, self.parent_ids, self.position_ids, window)
        return self._masks[key]

    @property
    def flex_length(self) -> int:
        """Row length flex runs on: ``T`` rounded up to the block size (cascade rows are unpadded)."""
        return -(-self.num_tokens // FLEX_BLOCK_SIZE) * FLEX_BLOCK_SIZE

    def block_mask(self, window: int | None):
        """FlexAttention ``BlockMask`` of the rule with ``window`` over ``flex_length`` rows (extra
        rows are padding: they see only padding, and nothing sees them)."""
        key = ("flex", window)
        if key not in self._masks:
            pad = self.flex_length - self.num_tokens
            segments, parents, positions = self.segment_ids, self.parent_ids, self.position_ids
            if pad:
                segments = torch.nn.functional.pad(segments, (0, pad), value=PAD_SEGMENT)
                parents = torch.nn.functional.pad(parents, (0, pad), value=PROMPT_PARENT)
                positions = torch.nn.functional.pad(positions, (0, pad), value=0)
            if self.ancestors is not None:
                self._masks[key] = tree_block_mask(segments, self.ancestors, FLEX_BLOCK_SIZE, positions, window)
            else:
                self._masks[key] = zorro_block_mask(segments, parents, FLEX_BLOCK_SIZE, positions, window)
        return self._masks[key]
