"""The embedded rollout engine: batched sampling with transformers' ``generate`` in the trainer process."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, ContextManager

import torch
from tensordict import TensorDict
from torch import nn

from grpo_accel import batch as K
from grpo_accel.logprobs import selected_logprobs
from grpo_accel.rollout.sampling import KeyedSampler


class EmbeddedEngine:
    """Samples ``group_size`` completions per prompt with the policy itself (weights are shared, not copied).

    Logprobs are reported as SGLang reports them: ``log_softmax(logits / temperature)`` at the sampled token,
    taken BEFORE top-k/top-p filtering. With those filters on, the reported distribution is not the one sampled
    from, which biases the importance ratio; keep ``top_k=0, top_p=1.0`` for unbiased GRPO.

    Args:
        model: the policy (unwrapped); generation runs in eval mode under ``torch.no_grad``.
        tokenizer: gives ``pad_token_id`` and ``eos_token_id``.
        max_new_tokens: completion budget; a completion that reaches it finishes with reason "length".
        gather: context manager factory entered around generation (gathers ZeRO-3 shards); none by default.

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
    ) -> None:
        from transformers import GenerationConfig

        self.model, self.temperature, self.top_k, self.top_p = model, float(temperature), top_k, top_p
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.gather = gather or contextlib.nullcontext
        self.weight_version = 0
        self.lock = threading.Lock()  # held while generating; a weight update waits for it (SGLang's writer lock)
        # Sampling is done by KeyedSampler (temperature, filters, keyed Gumbel noise) on top of greedy decoding.
        self.generation_config = GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=self.eos_id, pad_token_id=self.pad_id,
            output_logits=True, return_dict_in_generate=True,
        )

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False) -> TensorDict:
        """Rollout TensorDict [len(prompt_ids) * group_size] (prompt, completion, engine logprobs, finish).

        ``seeds`` (one per prompt) fix each completion's random stream: completion j of a prompt with seed s
        is the same whatever else is generated with it. Without seeds, they are drawn from torch's RNG.
        ``greedy`` takes the most likely token instead of sampling (evaluation).
        """
        repeated = [p for p in prompt_ids for _ in range(group_size)]
        ids = K.pad_sequences(repeated, self.pad_id, "left")  # [N, P]
        mask = K.pad_sequences([[1] * len(p) for p in repeated], 0, "left")
        if seeds is None:
            seeds = torch.randint(0, 2**56, (len(prompt_ids),)).tolist()
        keys = torch.tensor([s * group_size + j for s in seeds for j in range(group_size)], dtype=torch.long)
        sampler = KeyedSampler(keys, ids.shape[1], self.temperature, self.top_k, self.top_p)
        device = next(self.model.parameters()).device
        with self.lock:
            was_training = self.model.training
            self.model.eval()
            try:
                with self.gather():
                    out = self.model.generate(
                        input_ids=ids.to(device), attention_mask=mask.to(device),
                        generation_config=self.generation_config, logits_processor=[] if greedy else [sampler],
                    )
            finally:
                self.model.train(was_training)
            version = self.weight_version
        completion = out.sequences[:, ids.shape[1] :]  # [N, C]
        is_eos = completion == self.eos_id
        after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # strictly after the first EOS
        completion_mask = (~after_eos).long()
        logprobs = torch.stack(  # one step at a time: never a [N, C, V] float32 tensor
            [selected_logprobs(step[:, None], completion[:, t, None], self.temperature)[:, 0] for t, step in enumerate(out.logits)],
            dim=1,
        ) if out.logits else torch.zeros(completion.shape)
        finish = torch.where(is_eos.any(1), K.FINISH_STOP, K.FINISH_LENGTH)
        n = len(repeated)
        return TensorDict(
            {
                K.PROMPT_IDS: ids,
                K.PROMPT_MASK: mask,
                K.COMPLETION_IDS: completion.where(completion_mask.bool(), self.pad_id).cpu(),
                K.COMPLETION_MASK: completion_mask.cpu(),
                K.ENGINE_LOGPROBS: (logprobs * completion_mask).float().cpu(),
                K.FINISH_REASON: finish.cpu(),
                K.WEIGHT_VERSION: torch.full((n,), version, dtype=torch.long),
            },
            batch_size=[n],
        )


class EmbeddedWeightSync:
    """Weight-sync sender for the embedded engine.

    When the engine generates from the trained model itself (synchronous GRPO), an update only bumps the
    version. When it has its own copy (``source`` is the trained model; asynchronous collection), the update
    copies the weights into it, waiting for the generation in progress to finish, like SGLang's writer lock.
    """

    def __init__(self, engine: EmbeddedEngine, source: nn.Module | None = None) -> None:
        self.engine, self.source = engine, source

    def update_weights(self) -> None:
        self.push(self.engine.weight_version + 1)

    @torch.no_grad()
    def push(self, version: int) -> None:
        """Give the engine the trained weights as ``version`` (a resumed trainer calls this with its own)."""
        with self.engine.lock:
            if self.source is not None and self.source is not self.engine.model:
                for dst, src in zip(self.engine.model.parameters(), self.source.parameters(), strict=True):
                    dst.copy_(src.detach())
            self.engine.weight_version = version
