"""The loss room: the GRPO objective (:mod:`grpo_accel.loss.grpo`, :class:`GRPOLoss` and its pure tensor functions)
and the forwards its logprobs take (:mod:`grpo_accel.loss.paths`: packed, shared prompts, padded).

``from grpo_accel.loss import GRPOLoss`` and the objective's functions are importable from here.
"""
from grpo_accel.loss.grpo import (
    token_log_ratio, sequence_log_ratio, IMPORTANCE_LEVELS, clipped_surrogate, without_truncated,
    engine_is_weights, TIS_MODES, kl_k1, kl_k2, kl_k3, KL_ESTIMATORS, masked_token_sum, sequence_token_mean_sum,
    token_units, sequence_units, constant_units, Aggregation, AGGREGATIONS, effective_sample_size,
    engine_mismatch, LOSS_OUTPUTS, KL_OUTPUTS, GRPOLoss,
)

__all__ = [
    "token_log_ratio", "sequence_log_ratio", "IMPORTANCE_LEVELS", "clipped_surrogate", "without_truncated",
    "engine_is_weights", "TIS_MODES", "kl_k1", "kl_k2", "kl_k3", "KL_ESTIMATORS", "masked_token_sum",
    "sequence_token_mean_sum", "token_units", "sequence_units", "constant_units", "Aggregation", "AGGREGATIONS",
    "effective_sample_size", "engine_mismatch", "LOSS_OUTPUTS", "KL_OUTPUTS", "GRPOLoss",
]
