"""Which forward a model's logprobs take, and the shared-prompt forward the loss uses by default.

The G completions of a group share their prompt, and the padded forward runs it G times. The shared forward
lays out one row per distinct prompt: the prompt, then k of its completions one after another, each
completion seeing the prompt and itself only (a 4-D mask, position ids continuing the prompt), so a prompt
runs once per k completions, in one forward that uses every weight once, as the padded forward does. The
price is attention over the longer row, so ``completions_per_row`` picks k from a cost count of the two; a batch
where k = 1 is cheapest (no prompt repeats, or long completions next to short prompts) runs padded.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_accel.attention import additive_dtype, mask_reason, model_mask, transformers_model
from grpo_accel.logprobs import padded_forward, position_ids_from_mask, sequence_logprobs

logger = logging.getLogger(__name__)


def distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor]:
    """-> first [U]: a row holding each distinct prompt, of_row [N]: which of them row i holds (row i's prompt
    is row ``first[of_row[i]]``'s); padding ids do not count."""
    key = torch.where(prompt_mask.bool(), prompt_ids, -1)  # [N, P]
    _, of_row = torch.unique(key, dim=0, return_inverse=True)  # [N] into U distinct rows
    rows = torch.arange(len(key), device=key.device)
    first = torch.full((int(of_row.max()) + 1,), len(key), device=key.device).scatter_reduce_(0, of_row, rows, "amin")
    return first, of_row


def completions_per_row(counts: list[int], prompt: int, width: int, hidden: int) -> int:
    """The k whose layout costs least: rows of a prompt (``prompt`` columns) and k completions of ``width``.

    Per layer and row of L tokens, the projections and MLP cost ~12 hidden^2 L multiply-adds and attention
    ~4 hidden L^2 (every query against every key, as SDPA computes under a mask), so a layout costs
    rows * (3 hidden L + L^2); ``counts``: the rows of each distinct prompt. Ties go to the smaller k.
    """
    def cost(k: int) -> int:
        length = prompt + k * width
        return sum(math.ceil(c / k) for c in counts) * (3 * hidden * length + length * length)

    return min(range(1, max(counts) + 1), key=lambda k: (cost(k), k))


@dataclass
class SharedRows:
    """The layout: R rows of L tokens; ``keep`` [K] columns reach the LM head; completion token t of row i is
    predicted at kept column ``column[i, t]`` of row ``row[i]``."""

    ids: Tensor  # [R, L]
    mask: Tensor  # [R, 1, L, L] bool, True: attend
    positions: Tensor  # [R, L]
    keep: Tensor  # [K]
    row: Tensor  # [N]
    column: Tensor  # [N, C]


def shared_rows(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                first: Tensor, of_row: Tensor, per_row: int) -> SharedRows:
    """Row r: a prompt (its P columns, left-padded), then ``per_row`` segments of W = C - 1 columns, one
    completion's inputs each (its last token predicts nothing and is not run)."""
    n, p = prompt_ids.shape
    w, device = completion_ids.shape[1] - 1, prompt_ids.device
    counts = torch.bincount(of_row)  # [U]
    order = torch.argsort(of_row, stable=True)
    rank = torch.empty_like(of_row)
    rank[order] = torch.arange(n, device=device) - (torch.cumsum(counts, 0) - counts)[of_row[order]]  # i among its prompt's rows
    row_base = torch.cumsum((counts + per_row - 1) // per_row, 0) - (counts + per_row - 1) // per_row  # [U]
    row = row_base[of_row] + rank // per_row  # [N]
    slot = rank % per_row  # [N] segment within the row
    rows, length = int(row.max()) + 1, p + per_row * w
    prompt_of_row = torch.zeros(rows, dtype=torch.long, device=device).index_put_((row,), first[of_row])
    ids = prompt_ids.new_zeros(rows, length)
    real = torch.zeros(rows, length, dtype=torch.bool, device=device)
    segment = torch.full((rows, length), -1, device=device)  # -1: the prompt
    positions = torch.zeros(rows, length, dtype=torch.long, device=device)
    ids[:, :p], real[:, :p] = prompt_ids[prompt_of_row], prompt_mask[prompt_of_row].bool()
    positions[:, :p] = position_ids_from_mask(prompt_mask[prompt_of_row])
    steps = torch.arange(w, device=device)
    col = p + slot[:, None] * w + steps  # [N, W] row i's segment
    at = (row[:, None].expand(-1, w), col)
    ids.index_put_(at, completion_ids[:, :w])
    real.index_put_(at, completion_mask[:, :w].bool())
    segment.index_put_(at, slot[:, None].expand(-1, w))
    positions.index_put_(at, prompt_mask.sum(1)[:, None] + steps)  # continuing the prompt's positions
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    sees = (segment[:, None, :] == -1) | (segment[:, None, :] == segment[:, :, None])  # [R, L(query), L(key)]
    mask = causal & real[:, None, :] & sees | torch.eye(length, dtype=torch.bool, device=device)  # padding sees itself
    keep = torch.cat([torch.tensor([p - 1], device=device), torch.arange(p, length, device=device)])  # [1 + per_row W]
    column = torch.cat([torch.zeros(n, 1, dtype=torch.long, device=device), 1 + slot[:, None] * w + steps], 1)
    return SharedRows(ids, mask[:, None], positions, keep, row, column)


def shared_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, per_row: int | None = None):
    """-> logits [R, K, V], rows [N, C], as ``padded_forward``, each prompt run once per k completions:
    ``per_row`` (at most a prompt's rows), or the cheapest k (``completions_per_row``)."""
    first, of_row = distinct_prompts(prompt_ids, prompt_mask)
    base, counts = transformers_model(model), torch.bincount(of_row).tolist()
    if per_row is None:
        per_row = completions_per_row(counts, prompt_ids.shape[1], completion_ids.shape[1] - 1, base.config.hidden_size)
    per_row = min(per_row, max(counts))
    if per_row == 1:
        return padded_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    rows = shared_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, first, of_row, per_row)
    out = model(input_ids=rows.ids, attention_mask=model_mask(rows.mask, additive_dtype(base)),
                position_ids=rows.positions, logits_to_keep=rows.keep, use_cache=False)
    return out.logits, rows.row[:, None] * len(rows.keep) + rows.column  # [R, K, V], [N, C]


class LogprobPaths:
    """Which forward each model's logprobs take, decided on its first micro-batch against the padded one.

    ``packing`` (opt-in) is refused with an error for a model whose packed logprobs differ or whose forward
    fails; ``shared_prompts`` (on by default) runs padded for a model that takes no 4-D mask of full attention,
    and for one whose shared logprobs differ or fail, with a warning.
    """

    def __init__(self, temperature: float, packing: bool = False, shared_prompts: bool = True) -> None:
        self.temperature, self.packing, self.shared_prompts = temperature, packing, shared_prompts and not packing
        self.checked: dict[int, bool] = {}  # id() of a model -> whether its path matched the padded one

    def __call__(self, inputs: tuple, with_entropy: bool = False):
        """``inputs``: (model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> ``sequence_logprobs``."""
        model = inputs[0]
        if self.packing and not self.checked.get(id(model)):
            self._check_packing(inputs)
        shared = self.shared_prompts and self._shares_prompts(inputs)
        return sequence_logprobs(*inputs, temperature=self.temperature, with_entropy=with_entropy,
                                 packed=self.packing, forward=shared_forward if shared else None)

    def _gap(self, inputs: tuple, **path) -> float:
        """Largest |padded - other path| logprob over the real completion tokens (0.0 with none), in full
        precision: float32 weights agree to float32 rounding (packing: <= 7e-7 on the 10m benchmark model)."""
        mask = inputs[4].bool()
        with torch.no_grad(), torch.autocast(mask.device.type, enabled=False):
            padded = sequence_logprobs(*inputs, temperature=self.temperature)
            other = sequence_logprobs(*inputs, temperature=self.temperature, **path)
        return float((padded - other)[mask].abs().max()) if mask.any() else 0.0

    @staticmethod
    def _bound(model) -> float:
        """Half-precision weights agreed to 6e-3 on the 10m benchmark model; a model that lets rows see one
        another's tokens is off by far more once trained."""
        return 1e-3 if next(model.parameters()).dtype in (torch.float32, torch.float64) else 0.1

    def _check_packing(self, inputs: tuple) -> None:
        model = inputs[0]
        if not inputs[4].bool().any():
            return  # nothing to compare: check on the next micro-batch
        try:
            gap = self._gap(inputs, packed=True)
        except Exception as err:  # e.g. a model without position_ids / tensor logits_to_keep
            raise ValueError(f"GRPOLoss: packing=True is invalid for {type(model).__name__}: its packed forward "
                             f"failed ({err}); set packing=False.") from err
        if gap > self._bound(model):
            raise ValueError(f"GRPOLoss: packing=True is invalid for {type(model).__name__}: packed logprobs differ "
                             f"from padded ones by up to {gap:.3g}, so its attention does not keep packed rows "
                             "apart (transformers >= 4.53 models do, from position ids); set packing=False.")
        self.checked[id(model)] = True
        logger.info("padding-free packing checked for %s: packed logprobs within %.2g of padded ones",
                    type(model).__name__, gap)

    def _shares_prompts(self, inputs: tuple) -> bool:
        model = inputs[0]
        if id(model) not in self.checked:
            name, reason = type(model).__name__, mask_reason(transformers_model(model))
            if reason is not None:
                self.checked[id(model)] = False
                logger.info("%s runs every row's prompt (no shared prompts): %s", name, reason)
                return False
            try:
                gap = self._gap(inputs, forward=functools.partial(shared_forward, per_row=2))  # the layout itself
            except Exception as err:  # e.g. a model that ignores position ids or a 4-D mask
                gap, reason = float("inf"), f"its shared forward failed ({err})"
            else:
                reason = f"its shared logprobs differ from padded ones by up to {gap:.3g}"
            self.checked[id(model)] = ok = gap <= self._bound(model)
            if ok:
                logger.info("shared prompts checked for %s: logprobs within %.2g of padded ones", name, gap)
            else:
                logger.warning("GRPOLoss: %s runs every row's prompt (shared_prompts off for it): %s.", name, reason)
        return self.checked[id(model)]
