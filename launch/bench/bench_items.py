"""The benchmark's speed items: each optimisation the trainer makes, before against after, in one run.

Every item times (or, for memory, measures the peak of) the same work done both ways on the same model
and the same tokens, and reports ``before / after``: above 1 means the optimisation pays. Used by
``python launch/bench/bench.py --items`` (one process); see that module for the phases themselves.
"""
from __future__ import annotations

import copy
import dataclasses
import re
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from tensordict import TensorDict

from grpo_accel import batch
from grpo_accel.runtime.resources import release_freed_memory

BIG_VOCAB, BIG_TOKENS = 32768, 4096  # the chunked-logprob item: a realistic vocabulary and micro-batch
RAGGED_COMPLETION = 128  # packing and trimming items: completions of 32..128 tokens (4x), prompts of 8..16


@dataclass
class Item:
    name: str
    before: float
    after: float
    unit: str  # "s" or "MB"
    how: str  # what "before" and "after" are

    @property
    def ratio(self) -> float:
        return self.before / self.after if self.after > 0 else float("inf")

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "ratio": self.ratio}


def timed(fn):
    """``(fn(), wall seconds)``, queued CUDA work included."""
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - start


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], reps: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``reps`` calls after ``warmup`` calls (CUDA work included)."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn)[1] for _ in range(reps))


@contextmanager
def peak_memory_mb(device: torch.device):
    """Yields a dict whose ``"mb"`` is set on exit to the peak memory above the level at entry.

    CUDA: the allocator's peak. CPU: the resident-set high-water mark, reset on entry through
    ``/proc/self/clear_refs`` (Linux) after the memory malloc keeps is released, so the number covers this block
    only.
    """
    out = {}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield out
        torch.cuda.synchronize()
        out["mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        return
    release_freed_memory()  # what malloc kept from earlier blocks would otherwise absorb this block's peak
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _proc_status_mb("VmRSS")
    yield out
    out["mb"] = _proc_status_mb("VmHWM") - base


def _proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) / 1024


def ragged_batch(vocab: int, rows: int, max_completion: int, device, seed: int = 0) -> TensorDict:
    """A rollout whose completion lengths spread evenly from max/4 to max (4x), prompts of 8-16 tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(8, 17, (rows,), generator=g).tolist()
    completion_lens = torch.linspace(max(1, max_completion // 4), max_completion, rows).round().long().tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in completion_lens]
    td = TensorDict({
        batch.PROMPT_IDS: batch.pad_sequences(prompts, 0, "left"),
        batch.PROMPT_MASK: batch.pad_sequences([[1] * n for n in prompt_lens], 0, "left"),
        batch.COMPLETION_IDS: batch.pad_sequences(completions, 0, "right"),
        batch.COMPLETION_MASK: batch.pad_sequences([[1] * n for n in completion_lens], 0, "right"),
        batch.ADVANTAGES: torch.randn(rows, generator=g),
    }, batch_size=[rows])
    return td.to(device)


def _forward_backward(loss_module, td: TensorDict) -> None:
    out = loss_module(td)
    out["loss_objective"].backward()
    loss_module.zero_grad(set_to_none=True)


def measure_items(model, engine, prompts: list[list[int]], group: int, rollout: TensorDict,
                  phases: dict[str, float], device: torch.device, threads: int) -> list[Item]:
    """Every speed item, measured now on ``model`` (a plain, unprepared module in one process)."""
    from grpo_accel.logprobs import selected_logprobs
    from grpo_accel.loss import GRPOLoss

    items = []
    train, logprob_pass = phases["train"], phases["logprob_pass"]
    items.append(Item("old logprobs from the rollout", train + logprob_pass, train, "s",
                      "training phase + a pi_old forward pass / training phase (batch used once on-policy)"))
    reference = copy.deepcopy(model).requires_grad_(False)
    ref_loss = GRPOLoss(model, reference, kl_coef=0.1)
    t_ref = median_time(lambda: torch.no_grad()(ref_loss.add_reference_logprobs)(batch.trim_padding(rollout.clone())))
    items.append(Item("no reference pass at kl_coef=0", train + t_ref, train, "s",
                      "training phase + the reference forward pass / training phase"))
    del reference, ref_loss

    ragged = ragged_batch(model.config.vocab_size, rollout.shape[0], RAGGED_COMPLETION, device)
    padded_loss, packed_loss = GRPOLoss(model, shared_prompts=False), GRPOLoss(model, packing=True)
    short = ragged[: max(1, ragged.shape[0] // 2)]  # the shorter half, still padded to the whole batch's width
    items.append(Item("micro-batch trimmed to its longest row",
                      median_time(lambda: _forward_backward(padded_loss, short)),
                      median_time(lambda: _forward_backward(padded_loss, batch.trim_padding(short))), "s",
                      "loss forward+backward of the shorter half of a 4x-ragged batch: padded to the batch / trimmed"))
    items.append(Item("padding-free packed training",
                      median_time(lambda: _forward_backward(padded_loss, ragged)),
                      median_time(lambda: _forward_backward(packed_loss, ragged)), "s",
                      f"loss forward+backward, {ragged.shape[0]} completions of {RAGGED_COMPLETION // 4}.."
                      f"{RAGGED_COMPLETION} tokens (4x): padded / packed"))

    items += _shared_prompt_items(model, rollout)

    rows = BIG_TOKENS
    logits = torch.randn(1, rows, BIG_VOCAB, device=device, dtype=next(model.parameters()).dtype)
    targets = torch.randint(0, BIG_VOCAB, (1, rows), device=device)

    def full_copy():
        z = logits.detach().requires_grad_()
        torch.log_softmax(z.float(), -1).gather(-1, targets[..., None]).sum().backward()

    def chunked():
        z = logits.detach().requires_grad_()
        selected_logprobs(z, targets).sum().backward()

    memory = []
    for fn in (full_copy, chunked):
        fn()  # warm-up outside the measured block
        with peak_memory_mb(device) as peak:
            fn()
        memory.append(peak["mb"])
    items.append(Item("chunked logprobs: peak memory", *memory, "MB",
                      f"forward+backward over {rows} tokens x {BIG_VOCAB} vocabulary: float32 log_softmax / chunked"))
    items.append(Item("chunked logprobs: time", median_time(full_copy), median_time(chunked), "s",
                      "the same two computations timed"))
    del logits

    items.append(_fused_adamw_item(model))
    items += _generation_items(engine, prompts, group)
    items.append(_threads_item(padded_loss, ragged, threads))
    return items


def _shared_prompt_items(model, rollout: TensorDict) -> list[Item]:
    """The loss's forward+backward on the rollout's groups: every row's prompt / each prompt once per k completions;
    on the rollout as generated, then with its prompts 8x longer (a chat prompt is tens to hundreds of tokens)."""
    from grpo_accel.loss import GRPOLoss

    keys = (batch.PROMPT_IDS, batch.PROMPT_MASK, batch.COMPLETION_IDS, batch.COMPLETION_MASK, batch.ADVANTAGES)
    td = batch.trim_padding(rollout.select(*keys).clone())
    longer = td.clone()
    longer[batch.PROMPT_IDS], longer[batch.PROMPT_MASK] = (td[k].repeat(1, 8) for k in keys[:2])
    padded, shared = GRPOLoss(model, shared_prompts=False), GRPOLoss(model)
    items = []
    for name, x in (("the rollout's prompts", td), ("prompts 8x longer", longer)):
        items.append(Item(f"shared prompts, {name}", median_time(lambda: _forward_backward(padded, x)),
                          median_time(lambda: _forward_backward(shared, x)), "s",
                          f"loss forward+backward, {x.shape[0]} completions, {x[batch.PROMPT_IDS].shape[1]}-token "
                          "prompts: every row's prompt / each prompt once per k of its completions"))
    return items


@contextmanager
def _settings(obj, **values):
    """Temporarily set attributes of ``obj`` (the engine's decode settings, or the engine itself)."""
    saved = {name: getattr(obj, name) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


def _generation_items(engine, prompts: list[list[int]], group: int) -> list[Item]:
    settings, seeds = engine.settings, list(range(len(prompts)))

    def generate():
        return engine.generate(prompts, group, seeds=seeds)

    per_prompt = median_time(lambda: [engine.generate([p], group, seeds=[s]) for p, s in zip(prompts, seeds)], reps=2)
    items = [Item("generation batched over prompts x group", per_prompt, median_time(generate, reps=2), "s",
                  f"one generate per prompt / one generate for all {len(prompts)} x {group}")]
    if engine.fast:
        with _settings(engine, fast=False):
            transformers_generate = median_time(generate, reps=3)
        items.append(Item("decode loop (rollout.decoder=fast)", transformers_generate, median_time(generate, reps=3), "s",
                          "transformers generate with the keyed sampler / our loop: one prefill per prompt, cache "
                          "allocated once, mask sliced, sampler fused (same tokens)"))
        if engine.decoder.lean:
            from grpo_accel.embedded.decode import Decoder

            lean = median_time(generate, reps=3)
            with _settings(engine, decoder=Decoder(engine.model, lean=False)):
                wrapped = median_time(generate, reps=3)
            items.append(Item("decode loop's lean forward", wrapped, lean, "s",
                              "the model's forward / its modules called without transformers' wrappers (same tokens)"))
            with _settings(engine.decoder.lean_forward, fused=lambda product: nullcontext([])):
                separate = median_time(generate, reps=3)
            items.append(Item("decode loop's fused projections", separate, median_time(generate, reps=3), "s",
                              "q/k/v and gate/up as separate products / each set as one product of weights "
                              "concatenated at each call"))
            if engine.decoder.lean_forward.native is not None:  # float32 on CPU with a C compiler
                native = median_time(generate, reps=3)
                with _settings(engine.decoder.lean_forward, native=None):
                    ops = median_time(generate, reps=3)
                items.append(Item("decode loop's C step", ops, native, "s",
                                  "torch ops between the products / one C call per stretch between two products "
                                  "(norms, rotary, cache write, attention, SiLU)"))
        if engine.decoder.packed is not None:  # float32 on CPU past PACK_MIN_BYTES of matrices
            packed = median_time(generate, reps=3)
            with _settings(engine.decoder, packed=None):
                linear = median_time(generate, reps=3)
            items.append(Item("decode loop's packed weights", linear, packed, "s",
                              "nn.Linear's MKL products / oneDNN on weights packed at each call (reorder included)"))
        with _settings(engine.decoder, no_grad=torch.no_grad):
            grad_mode = median_time(generate, reps=3)
        items.append(Item("decode loop in inference mode", grad_mode, median_time(generate, reps=3), "s",
                          "our loop under torch.no_grad / under torch.inference_mode (no autograd bookkeeping per op)"))
        items.append(_later_turn_item(engine, prompts, group))
    # Random weights almost never sample EOS, so completions are made to end early: a forward hook raises the EOS
    # logit by 4 (about 1 in 3 draws); the batch then ends with its longest completion instead of at the budget.
    def likelier_eos(module, inputs, logits):
        index = torch.tensor(settings.stop_ids[:1], device=logits.device)
        return logits.index_add(-1, index, logits.new_full((*logits.shape[:-1], 1), 4.0))

    hook = engine.model.get_output_embeddings().register_forward_hook(likelier_eos)
    try:
        with _settings(settings, min_new_tokens=settings.max_new_tokens):
            full_length = median_time(generate, reps=2)
        with _settings(settings, min_new_tokens=0):
            early = median_time(generate, reps=2)
            longest = int(generate()[batch.COMPLETION_MASK].sum(1).max())
    finally:
        hook.remove()
    items.append(Item("generation stops when all finished", full_length, early, "s",
                      f"every sequence to the {settings.max_new_tokens}-token budget / stop when all stopped "
                      f"(EOS made likelier: longest completion {longest} tokens)"))
    return items


def _later_turn_item(engine, prompts: list[list[int]], group: int) -> Item:
    """A later turn of multi-turn episodes: each prompt prefilled once for its rows, then each row's own 16 tokens
    (``continue_rows``), against each row's whole context (``generate``); the same draws. Prompts are made 8x
    longer (a chat prompt with its tools and an example is hundreds of tokens; an episode's turn tens)."""
    long = [p * 8 for p in prompts]
    rows = [i for i in range(len(long)) for _ in range(group)]
    suffixes = [long[i][:16] for i in rows]
    keys = list(range(len(rows)))
    whole = median_time(lambda: engine.generate([long[i] + x for i, x in zip(rows, suffixes)], 1, seeds=keys), reps=2)
    shared = median_time(lambda: engine.continue_rows(long, rows, suffixes, keys), reps=2)
    return Item("episodes' later turns: prompt prefilled once", whole, shared, "s",
                f"{len(rows)} rows of a {len(long[0])}-token prompt + 16 own tokens: each whole context / the prompt "
                "once per prompt, then each row's own tokens (same draws)")


def _fused_adamw_item(model) -> Item:
    """AdamW's step over the model's parameters (random gradients): a loop over tensors against one fused kernel."""
    params = [p.detach().clone().requires_grad_() for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    loop, fused = torch.optim.AdamW(params, lr=1e-5), torch.optim.AdamW(params, lr=1e-5, fused=True)
    return Item("fused AdamW step", median_time(loop.step, reps=5), median_time(fused.step, reps=5), "s",
                f"AdamW step over {len(params)} tensors: per-tensor loop (torch's CPU default) / fused=True")


def _threads_item(loss_module, td: TensorDict, threads: int) -> Item:
    """Threads from the cores (what ``configure_threads`` set) against 4x oversubscription."""
    try:
        torch.set_num_threads(4 * threads)
        over = median_time(lambda: _forward_backward(loss_module, td))
    finally:
        torch.set_num_threads(threads)
    return Item("torch threads from the cores", over, median_time(lambda: _forward_backward(loss_module, td)), "s",
                f"loss forward+backward with {4 * threads} threads / {threads} (cores / local processes)")


def items_table(items: list[dict]) -> str:
    """The items (as ``Item.to_json`` writes them) as a text table."""
    lines = [f"{'speed item':<42}{'before':>10}{'after':>10}{'ratio':>8}  before / after"]
    for it in items:
        lines.append(f"{it['name']:<42}{it['before']:>10.4g}{it['after']:>10.4g}{it['ratio']:>7.2f}x  "
                     f"{it['unit']}: {it['how']}")
    return "\n".join(lines)
