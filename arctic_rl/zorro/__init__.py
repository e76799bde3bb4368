"""ZoRRo Train: prompt-deduplicated log-probs with exact gradients (no Lightning imports here).

    from arctic_rl.zorro import zorro_response_logprobs, dedup_stats

    logprobs, entropy = zorro_response_logprobs(model, prompt_token_ids, response_ids, response_mask,
                                                temperature, with_entropy, pad_token_id)
    log_dict(dedup_stats(prompt_token_ids, response_mask).as_metrics())

Modules: ``packing`` (pure layout), ``prefix_tree`` (the batch as a trie: every shared prefix once,
``dedup="tree"``) with its masks in ``tree_masks``, ``microbatch`` (token-budget planner), ``masks`` (dense and
FlexAttention block masks, windows included), ``features`` (each layer's window / soft-cap / sinks
and the guards), ``packed_mask`` (the layout as the 4D mask every layer receives), ``cascade``
(cascade attention on fused kernels), ``attention`` (the ``AttentionInterface`` function),
``logprobs``, ``head_spec`` (the model's own logit transform, measured), ``head_kernels`` (fused
Triton head) and ``sequence_parallel`` (Ulysses: one packed row split over N ranks, exchanged at each attention).
"""

from arctic_rl.zorro.attention import install_zorro_attention, register_zorro_attention
from arctic_rl.zorro.features import AttentionFeatures, ZorroUnsupportedModel, resolve_layer_features
from arctic_rl.zorro.logprobs import chunked_token_logprobs, zorro_response_logprobs
from arctic_rl.zorro.masks import dense_zorro_mask, zorro_block_mask
from arctic_rl.zorro.microbatch import plan_micro_batches
from arctic_rl.zorro.packing import DedupStats, PackedLayout, dedup_stats, pack_shared_prompts, response_extents, response_lengths
from arctic_rl.zorro.prefix_tree import pack_prefix_tree, tree_dedup_stats
from arctic_rl.zorro.sequence_parallel import SequenceParallel, SequenceParallelError

__all__ = [
    "AttentionFeatures",
    "DedupStats",
    "PackedLayout",
    "SequenceParallel",
    "SequenceParallelError",
    "ZorroUnsupportedModel",
    "chunked_token_logprobs",
    "dedup_stats",
    "dense_zorro_mask",
    "install_zorro_attention",
    "pack_prefix_tree",
    "pack_shared_prompts",
    "plan_micro_batches",
    "register_zorro_attention",
    "resolve_layer_features",
    "response_extents",
    "response_lengths",
    "tree_dedup_stats",
    "zorro_block_mask",
    "zorro_response_logprobs",
]
