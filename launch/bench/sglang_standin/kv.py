"""The stand-in's running batch with a KV cache (``--kv-cache``): the decode pace of a real server at 135M.

Without it the stand-in computes each request's next token with a full forward of its whole sequence, one
request at a time: correct, cheap for the tiny test models, and far slower than any server for a real model
(SmolLM2-135M: ~0.2 s per request and token on one core). SGLang keeps each running request's keys and values in
its pool and decodes the running batch together, one token per request per step (0.5.23
srt/managers/schedule_batch.py ``ScheduleBatch.prepare_for_decode``); requests that finish or are retracted
leave the batch (``ScheduleBatch.filter_batch``) and a prefilled batch joins it (``ScheduleBatch.merge_batch``).
Here the batch's cache is a transformers cache over the left-padded rows: a step whose requests are the cached
rows, in order, each one token longer, decodes one token per row; rows that left are dropped from the cache;
anything else (new requests, retracted ones coming back, weights loaded or memory released since) is computed
again from the requests' tokens, as SGLang recomputes a retracted request. Each row's logits are those of its
own tokens (the padding is masked), so the tokens follow the same distribution as the full forward's; they are
not batch-invariant in float32, which is why ``--deterministic`` runs keep the full forward."""
import inspect

import torch
from transformers import DynamicCache


class RunningBatch:
    """One dp rank's decode batch and its cache; ``logits`` gives each request's logits for the step."""

    def __init__(self) -> None:
        self.reqs: list = []  # the cached rows, in order
        self.lengths: list[int] = []  # tokens each row's cache holds
        self.cache = self.mask = None
        self.weights = None  # the server's weight epoch the cache was computed with

    @torch.no_grad()
    def logits(self, model, batch: list, weights: int) -> list[torch.Tensor]:
        """Per request of ``batch``: [its tokens, V] when its row was computed anew, else [1, V]."""
        index = {id(r): i for i, r in enumerate(self.reqs)}
        rows = [index.get(id(r)) for r in batch]
        reusable = (weights == self.weights and None not in rows and rows == sorted(rows)
                    and all(len(r.prompt) + len(r.output_ids) == self.lengths[i] + 1 for r, i in zip(batch, rows)))
        if not reusable:
            return self._compute(model, batch, weights)
        if len(rows) < len(self.reqs):  # filter_batch: the finished and retracted leave
            self.cache.batch_select_indices(torch.tensor(rows))
            self.mask = self.mask[rows]
        self.reqs, self.lengths = list(batch), [self.lengths[i] + 1 for i in rows]
        last = torch.tensor([[r.output_ids[-1] if r.output_ids else r.prompt[-1]] for r in batch])  # [B, 1]
        self.mask = torch.cat([self.mask, torch.ones(len(batch), 1, dtype=self.mask.dtype)], 1)  # [B, L + 1]
        positions = torch.tensor(self.lengths)[:, None] - 1  # [B, 1]
        out = model(input_ids=last, attention_mask=self.mask, position_ids=positions, use_cache=True,
                    **{cache_argument(model): self.cache})  # the cache grows in place
        return list(out.logits.float())  # B x [1, V]

    def _compute(self, model, batch: list, weights: int) -> list[torch.Tensor]:
        seqs = [r.prompt + r.output_ids for r in batch]
        width = max(map(len, seqs))
        ids = torch.tensor([[0] * (width - len(s)) + s for s in seqs])  # [B, L] left-padded
        self.mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])  # [B, L]
        positions = (self.mask.cumsum(1) - 1).clamp(min=0)  # [B, L]
        self.cache, self.weights = DynamicCache(), weights
        out = model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True,
                    **{cache_argument(model): self.cache})
        self.reqs, self.lengths = list(batch), [len(s) for s in seqs]
        return [out.logits[i, width - len(s):].float() for i, s in enumerate(seqs)]  # B x [len, V]


def cache_argument(model) -> str:
    """The forward's name for the cache: ``cache`` in newer transformers, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
