"""The embedded rollout engine: batched sampling with the policy in the trainer process (grpo_accel's decode loop,
or transformers' ``generate``), one turn of multi-turn episodes at a time too (``continue_rows``)."""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Callable, ContextManager

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from grpo_accel import batch
from grpo_accel.contracts import RolloutEngine
from grpo_accel.distributed import first_process, zero3_collective
from grpo_accel.logprobs import selected_logprobs
from grpo_accel.embedded.decode import DECODERS
from grpo_accel.rollout.sampling import KeyedSampler, batch_seeds, completion_keys

if TYPE_CHECKING:
    from grpo_accel.embedded.decode import Decoder
    from grpo_accel.embedded.worker import DecodeWorker

logger = logging.getLogger(__name__)


class EmbeddedEngine(RolloutEngine):
    """Samples ``group_size`` completions per prompt with the policy itself (weights are shared, not copied).

    Logprobs are reported as SGLang reports them: ``log_softmax(logits / temperature)`` at the sampled token,
    taken BEFORE top-k/top-p filtering. With those filters on, the reported distribution is not the one sampled
    from, which biases the importance ratio; keep ``top_k=0, top_p=1.0`` for unbiased GRPO.

    Args:
        model: the policy (unwrapped); generation runs in eval mode under ``torch.no_grad``.
        tokenizer: gives ``pad_token_id`` and ``eos_token_id``; a completion also stops at every id that the
            model's ``generation_config.eos_token_id`` lists (:func:`grpo_accel.batch.stop_token_ids`).
        max_new_tokens: completion budget; a completion that reaches it finishes with reason "length".
        gather: context manager factory entered around generation (gathers ZeRO-3 shards); none by default.
        decoder: "fast" decodes with :class:`grpo_accel.embedded.decode.Decoder` (the model's forward in a lean
            loop), "compiled" the same with the forward under ``torch.compile`` (a slow first call, then faster
            steps), "generate" with transformers' ``generate``; "auto" takes "fast" when the model allows it (see
            :func:`~grpo_accel.embedded.decode.unsupported_reason`). All draw the same tokens for the same keys
            (compiled kernels round differently in low precision, so a near-tie can flip a draw there).
        worker: decode in a process of its own (:class:`~grpo_accel.embedded.worker.DecodeWorker`, started at the
            first ``generate``), on ``model``'s weights in shared memory: for asynchronous collection on CPU,
            where generation then runs beside training instead of taking turns with it. ``model`` must be the
            engine's own copy (updated in place by :class:`EmbeddedWeightSync`). The two processes split this
            one's torch threads (set here, half each, at least one). Call :meth:`close` at the end.

    Example:
        >>> engine = EmbeddedEngine(model, tokenizer, max_new_tokens=4)
        >>> rollout = engine.generate([[7, 14, 8, 17]], group_size=8)   # TensorDict [8]
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        gather: Callable[[], ContextManager] | None = None,
        decoder: str = "auto",
        worker: bool = False,
    ) -> None:
        from grpo_accel.embedded.decode import DecodeSettings, unsupported_reason

        if decoder not in DECODERS:
            raise ValueError(f"EmbeddedEngine: decoder={decoder!r} is not one of {DECODERS}.")
        reason = unsupported_reason(model)
        if decoder in ("fast", "compiled") and reason is not None:
            raise ValueError(f"EmbeddedEngine: decoder={decoder!r} cannot decode this model: {reason}; use 'auto' or "
                             "'generate' (transformers' generate).")
        self.fast = decoder != "generate" and reason is None
        self.description = None if self.fast else (
            f"decode: transformers' generate ({'rollout.decoder=generate' if reason is None else reason})")
        self._said = False
        if worker and (not self.fast or gather is not None or next(model.parameters()).device.type != "cpu"):
            raise ValueError("EmbeddedEngine: worker=True decodes a CPU model with the fast decoder and no ZeRO-3 "
                             f"gather (here: decoder={decoder!r}{f' ({reason})' if reason else ''}, gather="
                             f"{gather is not None}, device {next(model.parameters()).device}); use worker=False.")
        self.compiled = decoder == "compiled"
        self.decoder: Decoder | None = None  # the in-process decode loop, built at the first generate
        self.worker: DecodeWorker | None = None
        self.use_worker = worker
        if worker:  # the worker decodes beside training: this process keeps half of its torch threads, it gets half
            self.worker_threads = max(1, torch.get_num_threads() // 2)
            torch.set_num_threads(self.worker_threads)
        self.model, self.gather = model, gather or contextlib.nullcontext
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stops = batch.stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.settings = DecodeSettings(max_new_tokens, stops, pad_id, float(temperature), top_k, top_p)
        self.weight_version = 0
        self.lock = threading.Lock()  # held while generating; a weight update waits for it (SGLang's writer lock)

    @property
    def pad_id(self) -> int:
        return self.settings.pad_id

    @property
    def max_new_tokens(self) -> int:
        return self.settings.max_new_tokens

    @property
    def temperature(self) -> float:
        return self.settings.temperature

    @property
    def context_limit(self) -> int | None:
        """The most prompt + completion tokens one sequence may hold: the model's ``max_position_embeddings``."""
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def collective(self) -> bool:
        """Whether every process must call :meth:`generate` together (ZeRO-3 partitions the weights over them)."""
        return zero3_collective()

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False) -> TensorDict:
        """Rollout TensorDict [len(prompt_ids) * group_size] (prompt, completion, engine logprobs, finish).

        ``seeds`` (one per prompt) fix each completion's random stream: completion j of a prompt with seed s
        is the same whatever else is generated with it. Without seeds, they are drawn from torch's RNG.
        ``greedy`` takes the most likely token instead of sampling (evaluation).
        """
        ids, mask = batch.padded(prompt_ids, self.pad_id, "left")  # [P, L] each
        keys = None if greedy else torch.tensor(completion_keys(batch_seeds(seeds, len(prompt_ids)), group_size))
        rows = torch.arange(len(prompt_ids)).repeat_interleave(group_size)
        return self._sample(ids, mask, keys, rows, prompts=(ids[rows], mask[rows]))

    @torch.no_grad()
    def continue_rows(self, prompt_ids: list[list[int]], rows: list[int], suffixes: list[list[int]],
                      keys: list[int] | None) -> TensorDict:
        """One more turn of multi-turn episodes: row i continues ``prompt_ids[rows[i]] + suffixes[i]`` with the
        random stream ``keys[i]`` (None: greedy), as ``generate`` would with that context and seed and group size
        1, but each prompt is prefilled once for all its rows (the fast decoder; ``generate`` re-reads contexts).
        A rollout [len(rows)] whose prompts are those contexts."""
        ids, mask = batch.padded(prompt_ids, self.pad_id, "left")  # [P, L] each
        suffix = batch.padded(suffixes, self.pad_id, "left")  # [N, S] each
        rows_t = torch.tensor(rows)
        contexts = _contexts(ids, mask, rows_t, suffix, self.pad_id)
        return self._sample(ids, mask, None if keys is None else torch.tensor(keys), rows_t, contexts, suffix)

    def _sample(self, ids: Tensor, mask: Tensor, keys: Tensor | None, rows: Tensor, prompts: tuple[Tensor, Tensor],
                suffix: tuple[Tensor, Tensor] | None = None) -> TensorDict:
        """Draw a completion for each row (continuing prompt ``rows[i]``, then its suffix): the rollout
        [len(rows)] of ``prompts`` (each row's whole context, padded: ids and mask)."""
        s = self.settings
        device = next(self.model.parameters()).device
        with self.lock:
            was_training = self.model.training
            self.model.eval()
            try:
                with self.gather():
                    if self.fast:
                        completion, logprobs = self._decode(ids.to(device), mask.to(device), keys, rows.to(device),
                                                            suffix and tuple(t.to(device) for t in suffix))
                    else:
                        completion, logprobs = self._generate(*prompts, keys)
            finally:
                self.model.train(was_training)
            version = self.weight_version
        if not self._said:  # the path of the first generation, said once: a user comparing machines sees it
            self._said = True
            if first_process():
                logger.info("%s", self.description)
        completion_mask = (~batch.after_stop(completion, s.stop_ids)).long()  # [N, C]
        stopped = batch.is_stop_token(completion, s.stop_ids).any(1)  # [N]
        finish = torch.where(stopped, batch.FINISH_STOP, batch.FINISH_LENGTH)
        completion = completion.where(completion_mask.bool(), s.pad_id)
        return batch.make_rollout(  # the lock keeps pushes out: every token is of one version
            prompts=prompts, completions=(completion.cpu(), completion_mask.cpu()),
            engine_logprobs=(logprobs * completion_mask).float().cpu(), finish_reason=finish.cpu(),
            weight_version=torch.full((completion.shape[0],), version), pad_id=s.pad_id)

    def close(self) -> None:
        """Stop the decode worker, if one runs."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def _decode(self, ids: Tensor, mask: Tensor, keys: Tensor | None, rows: Tensor,
                suffix: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        if self.use_worker and self.worker is None:
            from grpo_accel.embedded.worker import DecodeWorker

            self.worker = DecodeWorker(self.model, self.compiled, threads=self.worker_threads)
            from grpo_accel.embedded.native import native_reason

            reason = native_reason()
            self.description = ("decode: the lean decode loop in a worker process (rollout.embedded_worker), "
                                + ("with its C step" if reason is None else f"without its C step: {reason}"))
        elif not self.use_worker and self.decoder is None:
            from grpo_accel.embedded.decode import Decoder

            self.decoder = Decoder(self.model, self.compiled)
            self.description = self.decoder.description
        more = {} if suffix is None else {"suffix_ids": suffix[0], "suffix_mask": suffix[1]}
        return (self.worker or self.decoder)(ids, mask, 1, keys, self.settings, prompt_of=rows, **more)

    def _generate(self, ids: Tensor, mask: Tensor, keys: Tensor | None) -> tuple[Tensor, Tensor]:
        """transformers' ``generate`` over rows [N, L] with the keyed sampler as its logits processor:
        (completion, logprobs)."""
        from transformers import GenerationConfig

        s = self.settings
        config = GenerationConfig(do_sample=False, max_new_tokens=s.max_new_tokens, min_new_tokens=s.min_new_tokens or None,
                                  eos_token_id=list(s.stop_ids), pad_token_id=s.pad_id, output_logits=True,
                                  return_dict_in_generate=True)
        device = next(self.model.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        processors = [] if keys is None else [KeyedSampler(keys, ids.shape[1], s.temperature, s.top_k, s.top_p)]
        out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config, logits_processor=processors)
        completion = out.sequences[:, ids.shape[1] :]  # [N, C]
        logprobs = torch.stack(  # one step at a time: never a [N, C, V] float32 tensor
            [selected_logprobs(step[:, None], completion[:, t, None], s.temperature)[:, 0] for t, step in enumerate(out.logits)],
            dim=1,
        )
        return completion, logprobs


def _contexts(ids: Tensor, mask: Tensor, rows: Tensor, suffix: tuple[Tensor, Tensor] | None,
              pad_id: int) -> tuple[Tensor, Tensor]:  # -> ids [N, L'], mask [N, L'], left-padded
    """Each row's whole context: its prompt (``ids[rows[i]]``) followed by its suffix, left-padded again."""
    if suffix is None:
        return ids[rows], mask[rows]
    joined, joined_mask = torch.cat([ids[rows], suffix[0]], 1), torch.cat([mask[rows], suffix[1]], 1)  # [N, L+S]
    order = joined_mask.argsort(dim=1, stable=True)  # each row's padding first, then its tokens in their order
    width = int(joined_mask.sum(1).max()) if rows.numel() else 0
    keep = order[:, order.shape[1] - width :]  # [N, L']
    out_mask = joined_mask.gather(1, keep)
    return joined.gather(1, keep).masked_fill(out_mask == 0, pad_id), out_mask
