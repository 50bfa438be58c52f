"""Shared by embedded/ and loss/.

Per-token logprobs and entropy of sampled tokens without a float32 [N, T, V] log-softmax copy.

``log p(y_t) = z[y_t] / tau - logsumexp(z / tau)``: a gather and a logsumexp, computed over row chunks so
that at most ``chunk_rows x V`` float32 values exist at once. The backward is written by hand for the same
reason: autograd would otherwise keep every chunk's float32 copy alive until backward.

While these forwards run with gradients, a tied input embedding (SmolLM2's, the tiny Qwen2's) adds its rows into
the LM head's weight gradient in place (:func:`tied_embedding_rows`).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo_accel.attention import transformers_model
from grpo_accel.distributed import zero3_partitioned

CHUNK_BYTES = 64 * 2**20  # float32 working set per chunk


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


class _SelectedLogprobs(torch.autograd.Function):
    """logits [R, V] (any float dtype), targets [M], rows [M] (the logits row predicting each target; a row may
    serve several targets, or none) -> logprobs [M], entropy [M] (no grad), both float32 (float64 for float64
    logits)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, rows: Tensor, temperature: float, with_entropy: bool):
        count, vocab = logits.shape
        compute = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for float64 logits
        lse = torch.empty(count, dtype=compute, device=logits.device)
        entropy = torch.zeros_like(lse)
        step = _chunk_rows(vocab)
        for s in range(0, count, step):
            z = logits[s : s + step].to(compute)  # [r, V]; a copy only when the dtype changes
            if temperature != 1.0:
                z = z / temperature
            lse[s : s + step] = torch.logsumexp(z, dim=-1)
            if with_entropy:  # H = lse - sum p z
                p = (z - lse[s : s + step, None]).exp_()
                entropy[s : s + step] = lse[s : s + step] - (p * z).sum(-1)
        picked = logits[rows, targets].to(compute)  # [M] z at the targets
        logp = (picked / temperature if temperature != 1.0 else picked) - lse[rows]
        ctx.save_for_backward(logits, targets, rows, lse)
        ctx.temperature = temperature
        entropy = entropy[rows]
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor):
        logits, targets, rows, lse = ctx.saved_tensors
        tau = ctx.temperature
        g = grad_logp.to(lse.dtype) / tau  # [M]
        per_row = torch.zeros_like(lse).index_add_(0, rows, g)  # [R] the gradients each row's targets take
        grad = torch.empty_like(logits)
        step = _chunk_rows(logits.shape[1])
        for s in range(0, logits.shape[0], step):
            z = logits[s : s + step].to(lse.dtype)
            p = z.sub(lse[s : s + step, None] * tau).mul_(1.0 / tau).exp_()  # softmax(z / tau) [r, V], one buffer
            p.mul_(-per_row[s : s + step, None])  # d logp / d z = (onehot - softmax) / tau, for each target
            here = (rows >= s) & (rows < s + step)
            p.index_put_((rows[here] - s, targets[here]), g[here], accumulate=True)
            grad[s : s + step].copy_(p)
        return grad, None, None, None, None


def selected_logprobs(
    logits: Tensor,  # [..., V]
    targets: Tensor,  # [N, T] long
    temperature: float = 1.0,
    with_entropy: bool = False,
    rows: Tensor | None = None,  # [N, T] long: the row of logits.reshape(-1, V) predicting each target
) -> Tensor | tuple[Tensor, Tensor]:  # [N, T] float32 or wider (and entropy [N, T])
    """log_softmax(logits / temperature) at ``targets``, chunked; entropy of the same distribution if asked.
    Without ``rows``, logits [N, T, V] predict the targets in order."""
    flat = logits.reshape(-1, logits.shape[-1])  # [R, V]
    if rows is None:
        rows = torch.arange(flat.shape[0], device=flat.device)
    logp, entropy = _SelectedLogprobs.apply(flat, targets.reshape(-1), rows.reshape(-1), temperature, with_entropy)
    logp = logp.view(targets.shape)
    return (logp, entropy.view(targets.shape)) if with_entropy else logp


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
    path with ``padded_forward``'s contract (``loss.paths.shared_forward``: each distinct prompt run once):
    ``forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> logits [..., V], rows [N, C]``,
    ``rows`` the row of ``logits.reshape(-1, V)`` that predicts each completion token (any row for padding).
    The logprobs are read at those rows, so no [N, C, V] copy of the logits is made.
    """
    forward = forward or (packed_forward if packed else padded_forward)
    with tied_embedding_rows(model):
        logits, rows = forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    res = selected_logprobs(logits, completion_ids, temperature, with_entropy, rows=rows)
    keep = completion_mask.to(torch.float32)
    return tuple(r * keep for r in res) if with_entropy else res * keep


@contextmanager
def tied_embedding_rows(model: nn.Module) -> Iterator[None]:
    """Forwards run under this add a tied input embedding's gradient rows into the LM head's gradient in place.

    A weight shared by the embedding and the LM head gets two gradients: the head's dense [V, H] one and the
    embedding's rows for the tokens the batch used. Left to autograd, the two meet in the weight's input buffer
    and are summed into a third [V, H] tensor: a dense embedding gradient was a fresh [V, H] of zeros plus an
    addition; a sparse one still an out-of-place sum, because the engine adds a sparse gradient into a dense one
    in place only when the sparse one arrives first, and the head's always does (SmolLM2: a 113 MB tensor more at
    the backward's peak, 943-965 against 853-859 MB for one forward + backward). Here the head's backward hands its weight
    gradient to the embedding's backward, which always runs after it (it needs the gradient of the whole network
    above it), adds its rows into it with ``index_add_`` and gives autograd that one tensor as the weight's
    gradient: no copy, and every hook on the weight sees its whole gradient once. Only a plain ``nn.Embedding``
    (no ``max_norm``, no ``scale_grad_by_freq``) whose weight is a plain bias-free ``nn.Linear`` head's, trained,
    with gradients on, outside ZeRO-3 (whose hooks gather and free the weight) and autocast; modules' hooks run.
    """
    pair = _tied_pair(model) if torch.is_grad_enabled() else None
    if pair is None:
        yield
        return
    embedding, head = pair
    link = _HeadGradient()
    embedding.forward = lambda ids: _TiedLookup.apply(ids, embedding.weight, link, embedding.padding_idx)
    head.forward = lambda hidden: _HeadProduct.apply(hidden, head.weight, link)
    try:
        yield
    finally:
        embedding.__dict__.pop("forward", None)
        head.__dict__.pop("forward", None)


class _HeadGradient:
    """The LM head's weight gradient, from the head's backward to the tied embedding's."""

    def __init__(self) -> None:
        self.grad: Tensor | None = None

    def add(self, grad: Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad.add_(grad)

    def take(self) -> Tensor | None:
        grad, self.grad = self.grad, None
        return grad


class _HeadProduct(torch.autograd.Function):
    """hidden [..., H] @ weight [V, H].T -> logits [..., V]; the weight's gradient goes to the link."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, link: _HeadGradient) -> Tensor:
        ctx.save_for_backward(hidden, weight)
        ctx.link = link
        return F.linear(hidden, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):  # [..., V]
        hidden, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])  # [R, V]
        if ctx.needs_input_grad[1]:
            ctx.link.add(flat.t().mm(hidden.reshape(-1, hidden.shape[-1])))  # [V, H], a tensor of its own
        grad_hidden = (flat @ weight).view(hidden.shape) if ctx.needs_input_grad[0] else None
        return grad_hidden, None, None


class _TiedLookup(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)``; the weight's gradient is the head's (taken from the link) with
    the looked-up rows added, or those rows alone where the head's gave none."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, link: _HeadGradient, padding_idx: int | None) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.link, ctx.padding_idx, ctx.weight_shape = link, padding_idx, weight.shape
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: Tensor):  # [..., H]
        (ids,) = ctx.saved_tensors
        ids, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])  # [R], [R, H]
        if ctx.padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            rows = rows.masked_fill((ids == ctx.padding_idx)[:, None], 0.0)
        total = ctx.link.take()
        if total is None:
            total = rows.new_zeros(ctx.weight_shape)
        return None, total.index_add_(0, ids, rows), None, None


def _tied_pair(model: nn.Module) -> tuple[nn.Embedding, nn.Linear] | None:
    """``model``'s input embedding and LM head when they share a weight and :func:`tied_embedding_rows` may
    take over their gradient."""
    base = transformers_model(model)
    if not hasattr(base, "get_input_embeddings") or zero3_partitioned():
        return None
    embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
    if type(embedding) is not nn.Embedding or type(head) is not nn.Linear or head.bias is not None:
        return None
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return None
    if torch.is_autocast_enabled(embedding.weight.device.type):
        return None
    return (embedding, head) if head.weight is embedding.weight and embedding.weight.requires_grad else None


def padded_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """-> logits [N, C + 1, V], rows [N, C] (see ``sequence_logprobs``)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P+C]
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    n, c = completion_ids.shape
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
        logits_to_keep=c + 1, use_cache=False,
    )
    # kept position t (sequence position P-1+t) predicts completion token t; the last predicts nothing
    return out.logits, torch.arange(n * (c + 1), device=ids.device).view(n, c + 1)[:, :-1]


def packed_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """-> logits [1, M, V] over the M real completion tokens, rows [N, C] (see ``sequence_logprobs``).

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
    rows = torch.zeros_like(completion_ids)  # [N, C]: padding reads row 0 (masked by the caller)
    rows[real] = (keep.cumsum(0) - 1)[pred]  # the grid-order row predicting each completion token
    return logits, rows
