"""Per-token logprobs and entropy of sampled tokens without a float32 [N, T, V] log-softmax copy.

``log p(y_t) = z[y_t] / tau - logsumexp(z / tau)``: a gather and a logsumexp, computed over row chunks so
that at most ``chunk_rows x V`` float32 values exist at once. The backward is written by hand for the same
reason: autograd would otherwise keep every chunk's float32 copy alive until backward.

A tied input embedding (SmolLM2's, the tiny Qwen2's) has its backward give the rows the batch used while these
forwards run (:func:`sparse_tied_embedding`).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import torch
from torch import Tensor, nn

from grpo_accel.attention import transformers_model
from grpo_accel.distributed import zero3_partitioned

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
            z = logits[s : s + step].to(compute)  # [r, V]; a copy only when the dtype changes
            if temperature != 1.0:
                z = z / temperature
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
            g = grad_logp[s : s + step, None].to(lse.dtype) / tau  # [r, 1]
            z = logits[s : s + step].to(lse.dtype)
            p = z.sub(lse[s : s + step, None] * tau).mul_(1.0 / tau).exp_()  # softmax(z / tau) [r, V], one buffer
            p.mul_(-g).scatter_add_(-1, targets[s : s + step, None], g)  # d logp / d z = (onehot - softmax) / tau
            grad[s : s + step].copy_(p)
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
    packed: bool = False,
    forward: Callable | None = None,
) -> Tensor | tuple[Tensor, Tensor]:  # [N, C] (zero on padding), and entropy [N, C]
    """Teacher-forced logprobs of the completion tokens; only positions predicting them reach the LM head.

    ``packed`` computes the same values on real tokens only (padding-free, see ``packed_forward``); check a
    model with ``GRPOLoss(packing=True)``, which compares the two paths on first use. ``forward`` is another
    path with ``padded_forward``'s contract (``logprob_paths.shared_forward``: each distinct prompt run once).
    """
    forward = forward or (packed_forward if packed else padded_forward)
    with sparse_tied_embedding(model):
        logits, targets, unpack = forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    res = selected_logprobs(logits, targets, temperature, with_entropy)
    return tuple(unpack(r) for r in res) if with_entropy else unpack(res)


@contextmanager
def sparse_tied_embedding(model: nn.Module) -> Iterator[None]:
    """Forwards run under this give a tied input embedding a sparse backward: the rows the batch used.

    A weight shared by the embedding and the LM head gets two gradients, the head's dense [V, H] one and the
    embedding's; dense, the latter is a fresh [V, H] of zeros with a few rows written, added to the head's into a
    third [V, H] (SmolLM2: 113 MB each; zeroing and adding them cost 0.3-0.4 s of a 2.8 s forward + backward here,
    most of it first touches of new memory). Sparse, autograd adds those rows into the head's gradient in place;
    the weight's ``.grad`` is the same dense sum (to float rounding: another order of addition). Only a plain
    ``nn.Embedding`` whose weight is the output embedding's, trained, with gradients on, outside ZeRO-3 (whose
    hooks gather and free the weight): an untied embedding's sparse gradient would reach the optimizer as it is.
    """
    embedding = _tied_embedding(model) if torch.is_grad_enabled() else None
    if embedding is None:
        yield
        return
    embedding.sparse = True  # read by nn.Embedding.forward; the autograd node keeps it for the backward
    try:
        yield
    finally:
        embedding.sparse = False


def _tied_embedding(model: nn.Module) -> nn.Embedding | None:
    """``model``'s input embedding when a sparse backward is safe for it (see :func:`sparse_tied_embedding`)."""
    base = transformers_model(model)
    if not hasattr(base, "get_input_embeddings") or zero3_partitioned():
        return None
    embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
    if type(embedding) is not nn.Embedding or embedding.sparse or head is None:
        return None
    return embedding if head.weight is embedding.weight and embedding.weight.requires_grad else None


def padded_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """-> logits [N, C, V], targets [N, C], unpack: [N, C] -> [N, C] zero on padding."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P+C]
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
        logits_to_keep=completion_ids.shape[1] + 1, use_cache=False,
    )
    keep = completion_mask.to(torch.float32)
    # position P-1+t predicts completion token t
    return out.logits[:, :-1], completion_ids, lambda values: values * keep


def packed_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """-> logits [1, M, V], targets [1, M] over the M real completion tokens, unpack: [1, M] -> [N, C].

    Rows are packed whole into bins of twice the longest row (first-fit decreasing), with position ids
    restarting at 0 for each row and no attention mask: transformers (>= 4.53) then isolates the rows from
    one another by their position ids. Why bins of 2x the longest row: at 1x every row longer than half a
    bin needs a bin of its own, and one single packed row would make SDPA's masked attention cost
    total-tokens squared; the benchmark measured 2x as the fastest of 1x, 2x, 4x and one row.
    """
    from grpo_accel.batch import pack_rows

    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, L]
    mask = torch.cat([prompt_mask, completion_mask], dim=1).bool()  # [N, L]
    lengths = mask.sum(1)  # [N]
    capacity = 2 * max(int(lengths.max()), 1)
    bins = pack_rows(lengths.tolist(), capacity)
    start = torch.zeros_like(lengths)  # [N] index of each row's first token in the flat grid [bins * capacity]
    for b, rows in enumerate(bins):
        start[rows] = b * capacity + torch.cumsum(lengths[rows], 0) - lengths[rows]
    positions = position_ids_from_mask(mask)  # [N, L]
    dest = (start[:, None] + positions)[mask]  # [R] grid index of each real token, row-major
    grid = max(len(bins), 1) * capacity
    grid_ids = ids.new_zeros(grid).index_put_((dest,), ids[mask])  # tail slots hold token 0: attended by none
    grid_pos = (torch.arange(grid, device=ids.device) % capacity).index_put_((dest,), positions[mask])
    # Completion token t of row i is predicted at row position P_i - 1 + t.
    real = completion_mask.bool()  # [N, C]
    pred = (start + prompt_mask.sum(1) - 1)[:, None] + torch.arange(completion_ids.shape[1], device=ids.device)
    pred = pred[real]  # [M] grid index predicting each completion token, row-major over [N, C]
    keep = torch.zeros(grid, dtype=torch.bool, device=ids.device)
    keep[pred] = True
    out = model(
        input_ids=grid_ids.view(-1, capacity), position_ids=grid_pos.view(-1, capacity),
        logits_to_keep=keep.view(-1, capacity), use_cache=False,
    )
    logits = out.logits.reshape(1, -1, out.logits.shape[-1])  # [1, M, V] in grid order
    targets = ids.new_zeros(grid).index_put_((pred,), completion_ids[real])[keep][None]  # [1, M] grid order
    order = (keep.cumsum(0) - 1)[pred]  # [M]: grid-order index of each completion token
    where = real.nonzero(as_tuple=True)

    def unpack(values: Tensor) -> Tensor:  # [1, M] grid order -> [N, C] zero on padding
        return values.new_zeros(completion_ids.shape).index_put(where, values[0, order])

    return logits, targets, unpack
