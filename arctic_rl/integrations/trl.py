"""``ArcticGRPOTrainer``: TRL's ``GRPOTrainer`` whose log-probs come from ZoRRo (each shared prompt
computed once, gradients exact) and whose loss is arctic-rl's loss family.

    from arctic_rl.integrations.trl import ArcticGRPOTrainer as GRPOTrainer   # the one changed line

TRL keeps the rest: datasets, generation, rewards, advantages, the optimizer loop, logging, callbacks.
Two of its methods are overridden (TRL 1.16's names; other versions warn at import):

* ``_get_per_token_logps_and_entropies``: every log-prob pass TRL makes (training, old policy,
  reference model) is one ``zorro_response_logprobs`` call per chunk instead of a padded forward.
* ``_compute_loss``: the loss is the registered loss ``GRPOConfig.loss_type`` names (``grpo_family_loss`` for
  TRL's names, or a plugin's, which gets the ``GRPOConfig``'s settings in ``fit``'s loss config names) with TRL's
  normalisers (``trl_mapping.py``), logging TRL's metric names, the loss's stats, ``zorro/naive_tokens``,
  ``zorro/processed_tokens`` and ``zorro/dedup_ratio``. Options arctic-rl's loss family does not
  express (entropy bonus, ``top_entropy_quantile``, ``off_policy_mask_threshold``, vLLM importance
  sampling correction, tool masks) keep TRL's own loss, still over ZoRRo log-probs; a warning names them.

Refused at construction: a MoE router auxiliary loss (set ``router_aux_loss_coef=0.0``), and a plugin loss
together with an option only TRL's own loss expresses. Refused at
the first forward: multimodal inputs and DDP (ZoRRo runs the model's decoder directly, outside DDP's
forward; use DeepSpeed or FSDP for several GPUs).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import trl
from trl import GRPOTrainer
from typing_extensions import override

from arctic_rl.integrations.trl_mapping import loss_settings, split_prompt_completion, trl_normalizer
from arctic_rl.loss_registry import compute_loss, get_loss, loss_needs
from arctic_rl.modules.losses import LossInputs, masked_mean
from arctic_rl.zorro import dedup_stats, zorro_response_logprobs
from arctic_rl.zorro.logprobs import ATTENTION_BACKENDS

TESTED_TRL = "1.16"
if not trl.__version__.startswith(TESTED_TRL + "."):
    warnings.warn(
        f"arctic_rl.integrations.trl overrides GRPOTrainer methods of TRL {TESTED_TRL}; installed trl {trl.__version__}",
        stacklevel=2,
    )


class ArcticGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with ZoRRo log-probs and arctic-rl's loss family (module docstring).

    Args:
        *args, **kwargs: ``GRPOTrainer``'s, unchanged.
        attention_backend: ZoRRo's attention kernel: ``auto`` (FlexAttention on CUDA, the SDPA reference
            on CPU), ``flex``, ``sdpa``, ``flash_varlen`` or ``cudnn`` (docs/gpu.md).
    """

    def __init__(self, *args: Any, attention_backend: str = "auto", **kwargs: Any) -> None:
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
        super().__init__(*args, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                f"ArcticGRPOTrainer: the MoE router auxiliary loss (router_aux_loss_coef={self.router_aux_loss_coef}) "
                "needs router logits, which ZoRRo's forward does not return; set GRPOConfig(router_aux_loss_coef=0.0)"
            )
        self.attention_backend = attention_backend
        args = self.args
        self.arctic_loss = loss_settings(
            self.loss_type, self.importance_sampling_level, self.epsilon_low, self.epsilon_high, args.delta,
            self.beta, args.use_bias_correction_kl, args.max_completion_length,
            sapo_temperatures=(args.sapo_temperature_pos, args.sapo_temperature_neg),
            vespo_params=(args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg),
        )
        self.trl_loss_options = self._options_outside_loss_family()
        if self.trl_loss_options and not get_loss(self.loss_type).builtin:  # TRL's own loss knows TRL's names only
            raise ValueError(
                f"ArcticGRPOTrainer: GRPOConfig.loss_type={self.loss_type!r} is a plugin loss, which TRL's own loss cannot "
                f"compute; unset {', '.join(self.trl_loss_options)} or choose one of TRL's loss types"
            )
        if self.trl_loss_options:
            warnings.warn(
                f"ArcticGRPOTrainer: {', '.join(self.trl_loss_options)} not in arctic-rl's loss family; "
                "the loss is TRL's own, over ZoRRo log-probs",
                stacklevel=2,
            )

    def _options_outside_loss_family(self) -> list[str]:
        """The ``GRPOConfig`` options set here that ``grpo_family_loss`` does not express."""
        options = []
        if self._entropy_bonus_enabled:
            options.append("the entropy bonus (entropy_coef / adaptive entropy)")
        if self.top_entropy_quantile < 1.0:
            options.append(f"top_entropy_quantile={self.top_entropy_quantile}")
        if self.off_policy_mask_threshold is not None:
            options.append(f"off_policy_mask_threshold={self.off_policy_mask_threshold}")
        if self.use_vllm and self.vllm_importance_sampling_correction:
            options.append("vllm_importance_sampling_correction")
        return options

    @override
    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """Response log-probs ``[N, C]`` (and entropies) of TRL's ``[prompt | completion]`` rows, ZoRRo
        over ``batch_size`` rows at a time (TRL's chunking); no aux loss (refused at construction)."""
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise ValueError(f"ArcticGRPOTrainer: ZoRRo log-probs are text-only; got multimodal inputs {given}")
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(
                "ArcticGRPOTrainer: ZoRRo runs the model's decoder directly, outside DDP's forward (its gradients would "
                "not be reduced); train on several GPUs with DeepSpeed or FSDP (accelerate config)"
            )
        module = self.accelerator.unwrap_model(model)
        prompts, completion_ids, completion_mask = split_prompt_completion(input_ids, attention_mask, logits_to_keep)
        step = batch_size or len(prompts)
        logps, entropies = [], []
        for start in range(0, len(prompts), step):
            rows = slice(start, start + step)
            with self.accelerator.autocast():
                logp, entropy = zorro_response_logprobs(
                    module, prompts[rows], completion_ids[rows], completion_mask[rows], self.temperature,
                    compute_entropy, self._tokenizer.pad_token_id, attention_backend=self.attention_backend,
                )
            logps.append(logp)
            entropies.append(entropy)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    @override
    def _compute_loss(self, model, inputs: dict[str, Any]) -> torch.Tensor:
        """One micro-batch's loss: the registered loss ``loss_type`` over ZoRRo log-probs (or TRL's own loss for the
        options listed in ``trl_loss_options``), logging the dedup counts."""
        mode = "train" if self.model.training else "eval"
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, mask = inputs["completion_ids"], inputs["completion_mask"]
        prompts = [row[keep.bool()].tolist() for row, keep in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        for name, value in dedup_stats(prompts, mask).as_metrics(prefix="zorro/").items():
            self._metrics[mode][name].append(value)
        if self.trl_loss_options or "tool_mask" in inputs:
            return super()._compute_loss(model, inputs)

        logprobs, entropy, _ = self._get_per_token_logps_and_entropies(
            model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask], 1),
            completion_ids.shape[1], compute_entropy=True,
        )
        old = inputs.get("old_per_token_logps")
        normalizer = trl_normalizer(
            self.arctic_loss, mask, float(inputs["num_items_in_batch"]), self.current_gradient_accumulation_steps,
            self.args.steps_per_generation, self.accelerator.num_processes, training=mode == "train",
        )
        name, options = self.arctic_loss.config.loss_type, self.arctic_loss.options
        loss, stats = compute_loss(name, LossInputs(
            logprobs, logprobs.detach() if old is None else old, inputs["advantages"], mask, normalizer,
            ref_logprobs=inputs["ref_per_token_logps"] if self.beta != 0.0 else None,
            entropy=entropy if "entropy" in loss_needs(name, options) else None,
        ), options)
        stats["entropy"] = masked_mean(entropy.detach(), mask)
        for name, value in stats.items():  # TRL's names; across processes, the mean of each process's mean
            self._metrics[mode][name].append(self.accelerator.gather(value.detach().reshape(1)).nanmean().item())
        return loss
