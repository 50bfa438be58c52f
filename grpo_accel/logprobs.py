"""Per-token logprobs and entropy of sampled tokens without a float32 [N, T, V] log-softmax copy.

``log p(y_t) = z[y_t] / tau - logsumexp(z / tau)``: a gather and a logsumexp, computed over row chunks so
that at most ``chunk_rows x V`` float32 values exist at once. The backward is written by hand for the same
reason: autograd would otherwise keep every chunk's float32 copy alive until backward.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

CHUNK_BYTES = 64 * 2**20  # float32 working set per chunk


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


class _SelectedLogprobs(torch.autograd.Function):
    """logits [R, V] (any float dtype), targets [R] -> logprobs [R], entropy [R] (no grad), both float32
    (float64 for float64 logits)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, with_entropy: bool):
        rows, vocab = logits.shape
        compute = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for float64 logits
        logp = torch.empty(rows, dtype=compute, device=logits.device)
        lse = torch.empty_like(logp)
        entropy = torch.zeros_like(logp)
        step = _chunk_rows(vocab)
        for s in range(0, rows, step):
            z = logits[s : s + step].to(compute) / temperature  # [r, V]
            lse[s : s + step] = torch.logsumexp(z, dim=-1)
            logp[s : s + step] = z.gather(-1, targets[s : s + step, None]).squeeze(-1) - lse[s : s + step]
            if with_entropy:  # H = lse - sum p z
                p = (z - lse[s : s + step, None]).exp_()
                entropy[s : s + step] = lse[s : s + step] - (p * z).sum(-1)
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor):
        logits, targets, lse = ctx.saved_tensors
        tau = ctx.temperature
        grad = torch.empty_like(logits)
        step = _chunk_rows(logits.shape[1])
        for s in range(0, logits.shape[0], step):
            g = grad_logp[s : s + step, None].to(lse.dtype)  # [r, 1]
            p = (logits[s : s + step].to(lse.dtype) / tau - lse[s : s + step, None]).exp_()  # softmax [r, V]
            d = -p * g  # d logp / d z = (onehot - softmax) / tau
            d.scatter_add_(-1, targets[s : s + step, None], g)
            grad[s : s + step] = (d / tau).to(logits.dtype)
        return grad, None, None, None


def selected_logprobs(
    logits: Tensor,  # [N, T, V]
    targets: Tensor,  # [N, T] long
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:  # [N, T] float32 or wider (and entropy [N, T])
    """log_softmax(logits / temperature) at ``targets``, chunked; entropy of the same distribution if asked."""
    n, t, v = logits.shape
    logp, entropy = _SelectedLogprobs.apply(logits.reshape(n * t, v), targets.reshape(n * t), temperature, with_entropy)
    logp = logp.view(n, t)
    return (logp, entropy.view(n, t)) if with_entropy else logp


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:  # [N, L] -> [N, L]
    """Positions counted over real tokens only, as transformers' ``generate`` does for left-padded prompts."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def sequence_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,  # [N, P] left-padded
    prompt_mask: Tensor,  # [N, P]
    completion_ids: Tensor,  # [N, C] right-padded
    completion_mask: Tensor,  # [N, C]
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:  # [N, C] (zero on padding), and entropy [N, C]
    """Teacher-forced logprobs of the completion tokens; only the C+1 last positions go through the LM head."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P+C]
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
        logits_to_keep=completion_ids.shape[1] + 1, use_cache=False,
    )
    logits = out.logits[:, :-1]  # [N, C, V]: position P-1+t predicts completion token t
    res = selected_logprobs(logits, completion_ids, temperature, with_entropy)
    keep = completion_mask.to(torch.float32)
    if with_entropy:
        return res[0] * keep, res[1] * keep
    return res * keep
