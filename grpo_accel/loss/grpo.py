"""The GRPO objective: pure tensor functions plus a thin :class:`GRPOLoss` module.

Shapes: ``N`` completions in a (micro-)batch, ``T`` completion tokens (right-padded), ``G`` the group size.
Every per-token tensor is paired with ``mask`` ([N, T], 1 on real completion tokens, 0 on padding).

The module's forward returns a TensorDict in torchrl's convention: keys starting with ``loss_`` are summed
into the objective by the trainer; every other key is a detached diagnostic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from grpo_accel import batch
from grpo_accel.contracts import LossModule
from grpo_accel.loss.paths import LogprobPaths
from grpo_accel.rules import check, check_choice, require


# ------------------------------------------------------------------------------------------ importance ratio


def token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:  # all [N, T] -> [N, T]
    """log(pi / pi_old) per token (PPO / GRPO)."""
    return logp - old_logp


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:  # all [N, T] -> [N, T]
    """GSPO: every token carries its sequence's length-normalised log ratio, mean_t log(pi / pi_old).

    Written in GSPO-token form, ``sg[s_i] + logp_t - sg[logp_t]``: the value is the sequence ratio and the
    gradient flows through each token, which with sequence-mean aggregation is exactly GSPO's gradient.
    """
    seq = ((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
    return seq.detach()[:, None] + logp - logp.detach()


IMPORTANCE_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio,
}


def clipped_surrogate(
    log_ratio: Tensor,  # [N, T]
    advantages: Tensor,  # [N]
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, Tensor]:  # per-token loss [N, T], clipped side [N, T] (int8: -1 low, +1 high, 0 none)
    """PPO's pessimistic surrogate with separate lower/upper clip (DAPO's clip-higher). A token is clipped low
    when its ratio is below 1 - eps_low with a negative advantage, high when above 1 + eps_high with a positive one
    (TRL's ``clip_ratio/low`` and ``/high``; either: its ``clip_ratio/region``)."""
    ratio = log_ratio.exp()
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    side = ((ratio > 1.0 + eps_high) & (adv > 0)).to(torch.int8) - ((ratio < 1.0 - eps_low) & (adv < 0)).to(torch.int8)
    return -torch.minimum(unclipped, clipped), side


def without_truncated(mask: Tensor, finish_reason: Tensor) -> Tensor:  # [N, T], [N] -> [N, T]
    """DAPO's overlong filtering (TRL's ``mask_truncated_completions``): the tokens of completions the length limit
    cut (finish reason "length") leave the loss; their rewards still count in their groups' statistics."""
    return mask * (finish_reason != batch.FINISH_LENGTH).to(mask.dtype)[:, None]


def engine_is_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str = "token_truncate",
                      cap: float | None = None, floor: float | None = None) -> Tensor:  # [N, T] x3 -> [N, T]
    """Importance weights pi_old / pi_engine against the inference engine that sampled, detached (TRL's
    ``vllm_importance_sampling_*``): per token or per completion (the product of its tokens' ratios), then
    truncated into [floor, cap] or masked (0) outside it. Modes: token_truncate, token_mask, sequence_truncate,
    sequence_mask."""
    check_choice("tis_mode", mode, TIS_MODES, owner="GRPOLoss: ")
    log_w = torch.nan_to_num((old_logp - engine_logp) * mask, nan=0.0)  # [N, T]: 0 outside the completion
    if mode.startswith("sequence"):
        log_w = log_w.sum(-1, keepdim=True)  # [N, 1]
    w = log_w.exp()
    if mode.endswith("truncate"):
        w = w.clamp(min=floor, max=cap)
    else:
        w = w.masked_fill((w < (floor if floor is not None else -math.inf)) | (w > (cap if cap is not None else
                                                                                        math.inf)), 0.0)
    return w.expand_as(old_logp).detach()


TIS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# ---------------------------------------------------------------------------------------------------- KL


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log(pi / pi_ref): unbiased, high variance, can be negative."""
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 0.5 * log(pi / pi_ref)^2: biased, low variance, >= 0."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = pi_ref/pi - log(pi_ref/pi) - 1: unbiased, >= 0 (the GRPO paper's estimator)."""
    d = ref_logp - logp
    return d.exp() - d - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}

# ------------------------------------------------------------------------------------------- aggregation
# A mode is (numerator, units): the loss is sum(numerator over every micro-batch and rank of an optimizer
# step) / sum(units over the same). The trainer sums the units of a whole step, so each micro-batch divides
# by the step's global count instead of its own (see step_normalizer below).


def masked_token_sum(token_loss: Tensor, mask: Tensor) -> Tensor:  # [N, T] -> []
    return (token_loss * mask).sum()


def sequence_token_mean_sum(token_loss: Tensor, mask: Tensor) -> Tensor:  # [N, T] -> []
    return ((token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()


def token_units(mask: Tensor, max_completion_tokens: int | None) -> Tensor:  # [N, T] -> []
    return mask.sum().float()


def sequence_units(mask: Tensor, max_completion_tokens: int | None) -> Tensor:  # [N, T] -> []
    return torch.tensor(float(mask.shape[0]), device=mask.device)


def constant_units(mask: Tensor, max_completion_tokens: int | None) -> Tensor:  # [N, T] -> []
    return torch.tensor(float(mask.shape[0] * max_completion_tokens), device=mask.device)


@dataclass(frozen=True)
class Aggregation:
    """A loss aggregation: its numerator over a micro-batch, and the units its denominator counts."""

    numerator: Callable[[Tensor, Tensor], Tensor]  # (token_loss [N, T], mask [N, T]) -> []
    units: Callable[[Tensor, int | None], Tensor]  # (mask [N, T], max_completion_tokens) -> []

    def __call__(self, token_loss: Tensor, mask: Tensor) -> Tensor:
        return self.numerator(token_loss, mask)


AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": Aggregation(masked_token_sum, token_units),  # DAPO: every token of the step weighs the same
    "seq_mean_token_mean": Aggregation(sequence_token_mean_sum, sequence_units),  # GRPO: mean of token means
    "seq_mean_token_sum_norm": Aggregation(masked_token_sum, constant_units),  # Dr. GRPO: over N * max_tokens
}


def effective_sample_size(log_w: Tensor, mask: Tensor) -> Tensor:  # [N, T] -> [], in (0, 1]
    """(sum w)^2 / (n sum w^2) over the real tokens: 1 when every importance weight is equal."""
    lw = log_w[mask.bool()].float()
    if lw.numel() == 0:
        return torch.ones((), device=log_w.device)
    return (2 * lw.logsumexp(0) - (2 * lw).logsumexp(0)).exp() / lw.numel()


def engine_mismatch(trainer_logp: Tensor, engine_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:  # [N, T] -> {}
    """How far the engine's logprobs of the sampled tokens are from the trainer's for the same weights: the mean
    absolute difference and the largest per-token probability ratio either way, exp(max |difference|)."""
    gap = (trainer_logp.detach().float() - engine_logp.float()).abs()[mask.bool()]
    if gap.numel() == 0:
        gap = gap.new_zeros(1)
    return {"engine_logprob_abs_diff": gap.mean(), "engine_prob_ratio_max": gap.max().exp()}


# ------------------------------------------------------------------------------------------------ module


LOSS_OUTPUTS = {  # GRPOLoss.forward's keys, once: loss_* are summed into the objective (torchrl's convention)
    "loss_objective": "the clipped surrogate, aggregated and normalised",
    "loss_kl": "kl_coef x the KL estimator to the reference (kl_coef > 0)",
    "kl_ref": "the KL estimator to the reference, mean over tokens (kl_coef > 0)",
    "clip_fraction": "share of tokens whose ratio was clipped (TRL's clip_ratio/region_mean)",
    "clip_low_fraction": "share clipped below 1 - eps_low with a negative advantage (TRL's clip_ratio/low_mean)",
    "clip_high_fraction": "share clipped above 1 + eps_high with a positive advantage (TRL's clip_ratio/high_mean)",
    "kl_approx": "KL(pi || pi_old), k3 form",
    "ESS": "effective sample size of the importance ratios",
    "entropy": "policy entropy, mean over tokens",
    "ratio_mean": "importance ratio", "ratio_min": "importance ratio", "ratio_max": "importance ratio",
    "engine_logprob_abs_diff": "mean |engine - trainer| logprob of the sampled tokens (sync; async with tis_cap: "
                               "with the engine's staleness)",
    "engine_prob_ratio_max": "largest per-token probability ratio engine/trainer either way (sync)",
}
KL_OUTPUTS = ("loss_kl", "kl_ref", "kl_approx")


class GRPOLoss(LossModule):
    """GRPO loss over a rollout TensorDict (keys in :mod:`grpo_accel.batch`).

    Args:
        policy: causal LM being trained (a transformers ``PreTrainedModel`` or anything returning ``.logits``).
        reference: frozen reference policy for the KL term; required iff ``kl_coef > 0`` (with 0 it is never run).
            A module, or a callable over the policy's own weights such as ``lora.BasePolicy(policy)``.
        clip_epsilon: PPO clip; a float, or ``(low, high)`` for clip-higher (DAPO uses (0.2, 0.28)).
        kl_coef: weight of the KL-to-reference term ``loss_kl``.
        kl_estimator: "k1", "k2" or "k3".
        aggregation: "token_mean" (DAPO), "seq_mean_token_mean" (GRPO) or "seq_mean_token_sum_norm" (Dr. GRPO).
        max_completion_tokens: Dr. GRPO's constant normaliser, the completion budget (the engine's
            ``max_new_tokens``, or an episode's: the collector's ``completion_budget``; the trainer checks); required
            by that mode.
        importance_level: "token" (PPO/GRPO ratio) or "sequence" (GSPO's length-normalised sequence ratio;
            with aggregation "seq_mean_token_mean" this is exactly GSPO, with "token_mean" GSPO-token weighting).
        tis_cap: if set, weight each token's loss by pi_old / pi_engine against the inference engine's logprobs
            (key ``engine_logprobs``), kept at most ``tis_cap`` (:func:`engine_is_weights`).
        tis_mode: how: token_truncate (min(ratio, cap) per token), token_mask (0 where a token's ratio is outside
            [tis_min, tis_cap]), sequence_truncate / sequence_mask (the same with each completion's ratio).
        tis_min: the lower bound of that range (None: none).
        kl_importance_weighted: multiply the KL term by the importance ratio (TRL's ``use_bias_correction_kl``:
            the unbiased reverse-KL gradient when pi != pi_old).
        temperature: the sampling temperature; logits are divided by it, as the engine did.
        packing: padding-free logprobs (rows packed with per-row position ids, see
            ``logprobs.sequence_logprobs``). On first use with each model the packed logprobs are compared to the
            padded ones, and a model that does not keep packed rows apart is refused with an error.
        mask_truncated: leave completions cut by the length limit out of the loss (:func:`without_truncated`).
        shared_prompts: run a group's prompt once for several of its completions (one row per prompt and k of
            its completions under a 4-D mask, k chosen per micro-batch by cost, see :mod:`grpo_accel.loss.paths`).
            On first use with each model the shared logprobs are compared to the padded ones; a model that
            differs, fails, or takes no 4-D mask of full attention runs padded. Ignored with ``packing``.

    Example:
        >>> loss_fn = GRPOLoss(policy, clip_epsilon=(0.2, 0.28))
        >>> out = loss_fn(rollout)            # TensorDict
        >>> total = out["loss_objective"]     # plus out["loss_kl"] when kl_coef > 0
    """

    uses_old_logprobs = True
    kl_outputs = KL_OUTPUTS

    def __init__(
        self,
        policy: nn.Module,
        reference: nn.Module | None = None,
        *,
        clip_epsilon: float | tuple[float, float] = 0.2,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        aggregation: str = "token_mean",
        max_completion_tokens: int | None = None,
        importance_level: str = "token",
        tis_cap: float | None = None,
        tis_mode: str = "token_truncate",
        tis_min: float | None = None,
        kl_importance_weighted: bool = False,
        temperature: float = 1.0,
        packing: bool = False,
        shared_prompts: bool = True,
        mask_truncated: bool = False,
    ) -> None:
        eps_low, eps_high = clip_epsilon if isinstance(clip_epsilon, (tuple, list)) else (clip_epsilon,) * 2
        check("clip_epsilon", "clip_epsilon", min(eps_low, eps_high), owner="GRPOLoss: ")
        check("kl_coef", "kl_coef", kl_coef, owner="GRPOLoss: ")
        _check(kl_coef == 0 or reference is not None, "kl_coef", kl_coef, "pass a reference model, or set kl_coef=0")
        check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS, owner="GRPOLoss: ")
        check_choice("aggregation", aggregation, AGGREGATIONS, owner="GRPOLoss: ")
        _check(
            aggregation != "seq_mean_token_sum_norm" or (max_completion_tokens or 0) > 0,
            "max_completion_tokens", max_completion_tokens,
            "Dr. GRPO aggregation divides by a constant: set it to the completion budget (the engine's "
            "max_new_tokens, or a multi-turn episode's budget: the collector's completion_budget)",
        )
        check_choice("importance_level", importance_level, IMPORTANCE_LEVELS, owner="GRPOLoss: ")
        check("tis_cap", "tis_cap", tis_cap, owner="GRPOLoss: ")
        check_choice("tis_mode", tis_mode, TIS_MODES, owner="GRPOLoss: ")
        check("temperature", "temperature", temperature, owner="GRPOLoss: ")
        # The reference is kept out of the parameter tree's gradients; under ZeRO it is sharded with the policy. A
        # reference that is no module (lora.BasePolicy: the policy with its adapter off) owns no parameters of its own.
        super().__init__(policy, reference if reference is not None and kl_coef > 0 else None)
        if isinstance(self.reference, nn.Module):
            self.reference.requires_grad_(False).eval()
        self.eps_low, self.eps_high = float(eps_low), float(eps_high)
        self.kl_coef, self.kl_estimator = float(kl_coef), kl_estimator
        self.aggregation, self.max_completion_tokens = aggregation, max_completion_tokens
        self.importance_level, self.tis_cap, self.temperature = importance_level, tis_cap, float(temperature)
        self.tis_mode, self.tis_min, self.kl_importance_weighted = tis_mode, tis_min, bool(kl_importance_weighted)
        self.packing, self.mask_truncated = bool(packing), bool(mask_truncated)
        self._paths = LogprobPaths(self.temperature, packing=self.packing, shared_prompts=bool(shared_prompts))
        self.shared_prompts = self._paths.shared_prompts  # off with packing

    # -- pieces the trainer calls outside forward -------------------------------------------------------

    @property
    def corrects_engine(self) -> bool:
        """Whether tokens are weighted by pi_old / pi_engine (``tis_cap`` set): see :class:`LossModule`."""
        return self.tis_cap is not None

    def logprobs(self, model: nn.Module, td: TensorDict, with_entropy: bool = False):
        """Per-token logprobs [N, T] of ``td``'s completion tokens under ``model`` (and entropy if asked)."""
        inputs = (model, td[batch.PROMPT_IDS], td[batch.PROMPT_MASK], td[batch.COMPLETION_IDS], td[batch.COMPLETION_MASK])
        return self._paths(inputs, with_entropy)

    @torch.no_grad()
    def add_old_logprobs(self, td: TensorDict) -> None:
        """Store pi_old (the current policy, before optimisation) as ``old_logprobs``."""
        td[batch.OLD_LOGPROBS] = self.logprobs(self.policy, td).detach()

    @torch.no_grad()
    def add_reference_logprobs(self, td: TensorDict) -> None:
        """Store the reference policy's logprobs as ``ref_logprobs`` (no-op when kl_coef is 0)."""
        if self.reference is not None:
            td[batch.REF_LOGPROBS] = self.logprobs(self.reference, td).detach()

    def loss_mask(self, td: TensorDict) -> Tensor:  # -> [N, T]
        """The tokens trained on: the model's own (``batch.loss_mask``), less truncated completions' if asked."""
        mask = batch.loss_mask(td)
        return without_truncated(mask, td[batch.FINISH_REASON]) if self.mask_truncated else mask

    def units(self, td: TensorDict) -> Tensor:
        """How much this micro-batch adds to the aggregation's denominator (see the aggregation modes above)."""
        return AGGREGATIONS[self.aggregation].units(self.loss_mask(td), self.max_completion_tokens)

    # -- forward --------------------------------------------------------------------------------------

    def forward(self, td: TensorDict, normalizer: float | Tensor | None = None) -> TensorDict:
        """Loss of the micro-batch ``td``; ``normalizer`` defaults to this micro-batch's own units."""
        mask = self.loss_mask(td).to(torch.float32)  # [N, T]: the model's own tokens (less truncated ones if asked)
        logp, entropy = self.logprobs(self.policy, td, with_entropy=True)  # [N, T] each
        old_logp = td.get(batch.OLD_LOGPROBS, None)
        if old_logp is None:  # used once, on-policy: pi_old is the current policy itself
            old_logp = logp.detach()
        log_ratio = IMPORTANCE_LEVELS[self.importance_level](logp, old_logp, mask)
        token_loss, clip_side = clipped_surrogate(log_ratio, td[batch.ADVANTAGES], self.eps_low, self.eps_high)
        if self.tis_cap is not None:
            token_loss = token_loss * engine_is_weights(old_logp, td[batch.ENGINE_LOGPROBS], mask, self.tis_mode,
                                                        self.tis_cap, self.tis_min)
        if normalizer is None:
            normalizer = self.units(td).clamp(min=1)  # no unit: nothing to train on, the loss is 0
        aggregate = AGGREGATIONS[self.aggregation]
        out = {"loss_objective": aggregate(token_loss, mask) / normalizer}
        if self.kl_coef > 0:
            ref_logp = td.get(batch.REF_LOGPROBS, None)
            if ref_logp is None:
                with torch.no_grad():
                    ref_logp = self.logprobs(self.reference, td)
            kl = KL_ESTIMATORS[self.kl_estimator](logp, ref_logp)  # [N, T]
            weighted = kl * log_ratio.exp() if self.kl_importance_weighted else kl
            out["loss_kl"] = self.kl_coef * aggregate(weighted, mask) / normalizer
            out["kl_ref"] = _masked_mean(kl.detach(), mask)
        out.update(self._diagnostics(log_ratio.detach(), old_logp, logp.detach(), entropy, clip_side, mask))
        if batch.ENGINE_LOGPROBS in td.keys():  # sync: pi_old is the trainer's view of the weights that sampled
            out.update(engine_mismatch(old_logp, td[batch.ENGINE_LOGPROBS], mask))
        return TensorDict(out, batch_size=[])

    @staticmethod
    def _diagnostics(log_ratio, old_logp, logp, entropy, clip_side, mask) -> dict[str, Tensor]:
        real = mask.bool()
        ratio = log_ratio.exp()[real]
        if ratio.numel() == 0:  # no real token: report a neutral ratio
            ratio = log_ratio.new_ones(1)
        return {
            "clip_fraction": _masked_mean((clip_side != 0).float(), mask),
            "clip_low_fraction": _masked_mean((clip_side < 0).float(), mask),
            "clip_high_fraction": _masked_mean((clip_side > 0).float(), mask),
            # KL(pi || pi_old) in the GRPO paper's k3 form: pi_old/pi - log(pi_old/pi) - 1, >= 0, 0 when on-policy
            "kl_approx": _masked_mean(kl_k3(logp, old_logp), mask),
            "ESS": effective_sample_size(log_ratio, mask),
            "entropy": _masked_mean(entropy, mask),
            "ratio_mean": ratio.mean(),
            "ratio_min": ratio.min(),
            "ratio_max": ratio.max(),
        }


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _check(ok: bool, name: str, value, fix: str) -> None:
    require(ok, name, value, f"{fix}.", owner="GRPOLoss: ")
