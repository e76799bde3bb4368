"""Sampling seeds: one independent, reproducible seed for every (step, prompt slot, sample, round).

GRPO's batch is only as diverse as its random streams. A single seed per request batch makes every
prompt reuse the same G streams (vLLM derives sample j's generator from the request seed), so the
rule here is: a prompt's seed is a hash of ``(seed, step, slot)``, where ``slot`` is the prompt's
position in the step's *global* batch (all data-parallel ranks together), and sample ``k`` of that
prompt draws from a hash of ``(prompt seed, k)``. Hashes, not sums: ``seed + step + k`` style
arithmetic collides across steps and prompts. Which engine, engine actor or rank serves a prompt
does not change its samples.

``model.sampling.seed: null`` turns the per-sample seeds off: every sample draws from its engine's own random
state, and the engine starts with a seed drawn from Python's ``random`` (:func:`engine_seed`), so that
``seed_everything`` alone decides whether two runs sample alike.
"""

from __future__ import annotations

import hashlib
import random
import struct

_MASK = (1 << 63) - 1  # vLLM and torch generators take a non-negative 64-bit seed


def mix_seed(*parts: int) -> int:
    """A well-mixed seed in ``[0, 2**63)`` from a tuple of integers (order matters)."""
    data = struct.pack(f"<{len(parts)}q", *(int(p) & _MASK for p in parts))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"arctic-rl-seed").digest(), "little") & _MASK


def global_slot(local_index: int, rank: int, world_size: int) -> int:
    """Position in the step's global batch of prompt ``local_index`` on ``rank``: the prompt sampler
    deals the global order round-robin (``rank::world_size``), so one rank with the whole batch and
    ``world_size`` ranks with a share each give every prompt the same slot."""
    return local_index * world_size + rank


def prompt_seeds(seed: int, step: int, num_prompts: int, rank: int = 0, world_size: int = 1,
                 sampling_round: int = 0) -> tuple[int, ...]:
    """The seed of each of this rank's ``num_prompts`` prompts at training step ``step``; round
    ``sampling_round >= 1`` of dynamic sampling (its extra prompts) hashes the round in as well."""
    extra = (sampling_round,) if sampling_round else ()  # round 0 keeps the seeds runs had before rounds existed
    return tuple(mix_seed(seed, step, global_slot(i, rank, world_size), *extra) for i in range(num_prompts))


def sample_seed(prompt_seed: int, sample: int) -> int:
    """The seed of sample ``sample`` (0..n-1) of a prompt whose seed is ``prompt_seed``."""
    return mix_seed(prompt_seed, sample)


def resolve_prompt_seeds(seed: int | None, seeds: tuple[int, ...] | None, num_prompts: int) -> tuple[int, ...] | None:
    """The seed of each prompt of one ``generate`` call: the caller's per-prompt ``seeds`` when given,
    else derived from ``seed`` and the prompt's index in the call; None when neither is set (the
    engine's own random state)."""
    if seeds is not None:
        if len(seeds) != num_prompts:
            raise ValueError(f"SamplingConfig.prompt_seeds has {len(seeds)} seeds for {num_prompts} prompts")
        return tuple(seeds)
    if seed is not None:
        return tuple(mix_seed(seed, i) for i in range(num_prompts))
    return None


def request_seeds(seed: int | None, seeds: tuple[int, ...] | None, num_prompts: int, n: int) -> list[list[int]] | None:
    """Per prompt, per sample seeds for one ``generate`` call (see :func:`resolve_prompt_seeds`)."""
    per_prompt = resolve_prompt_seeds(seed, seeds, num_prompts)
    if per_prompt is None:
        return None
    return [[sample_seed(s, k) for k in range(n)] for s in per_prompt]


def engine_seed(seed: int | None) -> int:
    """The seed a rollout engine starts with: ``seed``, or for an unseeded run (None) one drawn from Python's
    ``random`` (seeded by ``seed_everything``), below ``2**31``: engine ``i`` of a pool gets ``seed + i``,
    and vLLM seeds NumPy with it (which takes ``[0, 2**32)``)."""
    return random.getrandbits(31) if seed is None else seed
