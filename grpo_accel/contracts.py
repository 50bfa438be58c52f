"""Shared by embedded/, loss/, reporting/, rollout/, server_rollouts.py, trainer/ and weight_sync/.

The parts that GRPOTrainer and the recipe plug together, declared once: what each part must provide, what it
may leave to a default, and who calls it when. A part of your own subclasses its contract here; the trainer and
the launcher call these members and nothing else (they never ask a part what it can do).

| contract            | built-in parts                                | called by                                  |
|---------------------|-----------------------------------------------|--------------------------------------------|
| RolloutEngine       | EmbeddedEngine, SGLangEngine, VLLMEngine      | the collector, episodes, evaluation        |
| Collector           | GRPOCollector                                 | the trainer (a background thread if async) |
| LossModule          | GRPOLoss                                      | the trainer, per micro-batch               |
| OptimizationStepper | MixedPrecisionOptimizationStepper             | the trainer, per micro-batch               |
| WeightSender        | EmbeddedWeightSync, SGLang's three senders,   | the trainer, after optimising; on resume   |
|                     | VLLMDiskSender                                |                                            |
| Logger              | TensorBoardLogger, Trackers (Accelerate's)    | the trainer's reporter                     |

Where torchrl's specification takes a duck type, so does the trainer: a weight-sync sender with only
``update_weights()`` and a logger with only ``log_scalar()`` are wrapped once, at construction
(:func:`as_weight_sender`, :func:`as_logger`).

Example (an engine of your own):
    >>> class EchoEngine(RolloutEngine):
    ...     pad_id, max_new_tokens = 0, 1
    ...     def generate(self, prompt_ids, group_size, seeds=None, greedy=False):
    ...         ...  # a TensorDict [len(prompt_ids) * group_size] built by grpo_accel.batch.make_rollout
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from tensordict import TensorDict

    from grpo_accel.layout import BatchLayout


class RolloutEngine(ABC):
    """Samples completions of token prompts and returns them as a rollout TensorDict (keys: :mod:`grpo_accel.batch`,
    built by :func:`grpo_accel.batch.make_rollout`).

    Every engine sets:
        pad_id: the id that pads prompts and completions.
        max_new_tokens: the completion budget of one call (one model turn of an episode).
    Defaults, overridden where an engine differs:
        weight_version: the version an in-process engine stamps on its rows: its sender sets it with the weights
            (:class:`~grpo_accel.embedded.sender.EmbeddedWeightSync`); the trainer owns the count. Engines of
            servers stamp what the servers report instead.
        context_limit: prompt + completion tokens one sequence may hold (None: no limit known).
        model: the module it generates from in this process (None: none here, e.g. a server's).
        collective: every process must call ``generate`` together (an in-process model that ZeRO-3 partitions).
        remote: generation runs in other processes, so a background thread may drive it beside training.
        temperature: the temperature it samples at (None: not known); the loss must divide logits by the same.
    """

    pad_id: int
    max_new_tokens: int
    temperature: float | None = None
    weight_version: int = 0
    context_limit: int | None = None
    model: nn.Module | None = None
    collective: bool = False
    remote: bool = False

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False) -> TensorDict:
        """A rollout [len(prompt_ids) * group_size]: the G completions of each prompt contiguous. ``seeds`` (one
        per prompt; None: random) fix the random streams, completion j of a prompt with seed s drawing from key
        ``s * group_size + j``; ``greedy`` takes the most likely tokens (evaluation)."""

    def continue_rows(self, prompt_ids: list[list[int]], rows: list[int], suffixes: list[list[int]],
                      keys: list[int] | None) -> TensorDict:
        """One more model turn of multi-turn episodes: row i continues ``prompt_ids[rows[i]] + suffixes[i]`` with
        random stream ``keys[i]`` (None: greedy), as ``generate`` would with that context, seed and group size 1
        (what this default does; the embedded engine prefills each prompt once for all its rows instead)."""
        contexts = [prompt_ids[r] + suffix for r, suffix in zip(rows, suffixes)]
        return self.generate(contexts, 1, seeds=keys, greedy=keys is None)

    def close(self) -> None:
        """Release what the engine holds (worker processes, connections); called once training is over."""


class Collector(ABC):
    """Yields scored rollouts, one per optimisation round (torchrl's ``BaseCollector`` role): each a TensorDict of
    this process's share of a collected batch, with ``reward`` and ``advantages`` (:mod:`grpo_accel.batch`).

    Every collector sets:
        layout: the :class:`~grpo_accel.layout.BatchLayout` of its batches (the trainer reads it, never rebuilds it).
    Defaults, overridden where a collector differs:
        rank: which share of each batch this process collects (``layout.processes`` shares in all).
        tokenizer: decodes completions for the logged samples (None: none are logged).
        engine: the :class:`RolloutEngine` it draws from (None: none the trainer needs to know of).
        collective: ``collect`` agrees with the other processes while it runs (e.g. on dynamic sampling's extra
            rounds), so a background thread cannot run it beside training.
        completion_budget: the most tokens the model writes in one of its completions (the engine's cap, or a
            multi-turn episode's budget; None: not known): the trainer checks a loss's constant divisor against it.
    """

    layout: BatchLayout
    rank: int = 0
    tokenizer: Any = None
    engine: RolloutEngine | None = None
    collective: bool = False
    completion_budget: int | None = None

    @abstractmethod
    def collect(self) -> TensorDict:
        """The next scored rollout [layout.completions_per_process]."""

    def __iter__(self) -> Iterator[TensorDict]:
        while True:
            yield self.collect()

    def state_dict(self) -> dict | None:
        """What a resumed run needs to continue exactly where this one was (None: nothing)."""
        return None

    def load_state_dict(self, state: dict | None) -> None:
        """Continue from a :meth:`state_dict`."""

    def close(self) -> None:
        """Release what the collector holds (its engine, reward workers); called once training is over."""


class LossModule(nn.Module):
    """What the trainer needs from a loss (torchrl's ``LossModule`` role).

    ``forward(micro_batch, normalizer)`` returns a TensorDict whose ``loss_*`` keys are summed into the objective
    and whose other keys are detached diagnostics (logged as their mean over the optimizer step). ``normalizer``
    is the optimizer step's :meth:`units` summed over its micro-batches and every process, divided by processes x
    accumulation: a loss that sums over the micro-batch and divides by it is the step's mean, however the step is
    split (None: the micro-batch's own units).

    Defaults, overridden where a loss differs:
        policy: the trained model (its config is saved with checkpoints, and an async engine must not share it).
        reference: a frozen reference policy; when set, the trainer stores its logprobs before optimising
            (:meth:`add_reference_logprobs`).
        uses_old_logprobs: the loss reads pi_old (``old_logprobs``); the trainer stores them before optimising
            (:meth:`add_old_logprobs`) when a batch serves more than one optimizer step.
        corrects_engine: the loss weights tokens by pi_old / pi_engine (truncated importance sampling against the
            engine's ``engine_logprobs``). In async collection pi_old is otherwise the engine's logprobs (the
            ratio is taken against the weights that sampled); a loss that corrects towards the engine gets the
            trainer's own forward at store time instead (the proximal policy of AReaL's decoupled objective), else
            its weight would be exactly 1.
        kl_outputs: the output keys that are KL terms or KL diagnostics (``log_kl=False`` leaves them out of
            the logs).
        temperature: the temperature its logprobs are taken at (logits divided by it; None: not a concern of
            this loss): the trainer checks it against the engine's.
        max_completion_tokens: the completion budget a constant-normalised aggregation divides by (Dr. GRPO; None:
            none): the trainer checks it against the collector's ``completion_budget``.
    """

    uses_old_logprobs: bool = False
    corrects_engine: bool = False
    kl_outputs: tuple[str, ...] = ()
    temperature: float | None = None
    max_completion_tokens: int | None = None

    def __init__(self, policy: nn.Module | None = None, reference: Any = None) -> None:
        super().__init__()
        self.policy, self.reference = policy, reference

    def units(self, td: TensorDict) -> Tensor:
        """How much micro-batch ``td`` adds to the normalizer: its completions, unless the loss counts otherwise."""
        return torch.tensor(float(td.shape[0]))

    def add_old_logprobs(self, td: TensorDict) -> None:
        """Store pi_old as ``td["old_logprobs"]`` (needed only when ``uses_old_logprobs``)."""
        raise NotImplementedError(f"{type(self).__name__} sets uses_old_logprobs but not add_old_logprobs")

    def add_reference_logprobs(self, td: TensorDict) -> None:
        """Store the reference policy's logprobs as ``td["ref_logprobs"]`` (needed only with a reference)."""
        raise NotImplementedError(f"{type(self).__name__} has a reference but no add_reference_logprobs")


class OptimizationStepper(ABC):
    """Backward, clipping and the optimizer step of each micro-batch (the specification's ``OptimizationStepper``).
    The trainer prepares ``optimizer`` with the loss module, then calls :meth:`bind` once."""

    optimizer: torch.optim.Optimizer

    @abstractmethod
    def bind(self, accelerator, module: nn.Module) -> None:
        """Called once ``module`` and ``optimizer`` are prepared by ``accelerator``."""

    @abstractmethod
    def autocast(self):
        """The context the forward (and the loss) runs in."""

    @abstractmethod
    def backward(self, loss: Tensor) -> None: ...

    @abstractmethod
    def step(self) -> dict[str, float]:
        """After every micro-batch's backward; steps when gradients are synchronised. Returns scalars to log."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`."""


class WeightSender(ABC):
    """Keeps an engine's weights current with the trainer's (the specification's ``weight_sync_sender``). Under
    several processes every training process calls it: it may gather ZeRO-3 shards (a collective).

    The weight version has one owner, the trainer (``GRPOTrainer.weight_version``, saved in its checkpoints): it
    names each push, and a sender delivers that name with the weights (an SGLang server reports it back; the
    embedded engine stamps it on the rows it draws). ``pushed`` only records the last version delivered.
    """

    pushed: int = 0
    stale: bool = False
    """The engine's weights are unknown at start (e.g. a server found with its weights released): the trainer
    pushes before its first collection. The same on every process."""

    @abstractmethod
    def push(self, version: int) -> None:
        """Give the engine the trained weights as ``version`` and record it in ``pushed`` once delivered. The
        trainer calls it after optimising and, on resume, with its restored version (a new process cannot know
        what the engine holds)."""

    def update_weights(self) -> None:
        """The specification's method, for a sender used without a trainer: the version after the last pushed."""
        self.push(self.pushed + 1)

    def close(self) -> None:
        """Release what the sender holds (e.g. a process group the servers joined); called once training is over."""

    def stats(self) -> dict[str, float]:
        """Numbers for the run's summary (e.g. seconds of the last push)."""
        return {}


class Logger(ABC):
    """Where scalars go (torchrl's ``Logger`` interface: ``log_scalar``)."""

    @abstractmethod
    def log_scalar(self, name: str, value: float, step: int | None = None) -> None: ...

    def log_scalars(self, scalars: dict[str, float], step: int | None = None) -> None:
        """Several scalars of one step (the trainer's ~40 per log): one call each unless the logger batches them."""
        for name, value in scalars.items():
            self.log_scalar(name, value, step)

    def log_text(self, name: str, text: str, step: int | None = None) -> None:
        """Markdown text; dropped unless the logger shows text."""

    def log_samples(self, rows: list[dict], step: int | None = None) -> None:
        """Completion samples, one dict per completion with the same keys (prompt, completion, reward, each
        reward function's value): a table where the logger has tables, Markdown where it shows text
        (:func:`grpo_accel.reporting.metrics.samples_markdown`); dropped unless the logger shows them."""

    def resume_at(self, step: int) -> None:
        """Training resumed after ``step``: what an interrupted run logged after it is dropped, where possible."""

    def flush(self) -> None: ...

    def close(self, outcome: str = "finished") -> None:
        """The end of the run: ``outcome`` is how it ended, one of ``OUTCOMES`` (trackers that keep a run's status,
        W&B's and MLflow's, record it)."""


OUTCOMES = ("finished", "failed", "killed")
"""How a run ends: trained to its end (or stopped by a hook), stopped by an error, stopped by a signal."""


class _UpdateWeightsSender(WeightSender):
    """A torchrl-style sender that has only ``update_weights()``: each push is one call of it."""

    def __init__(self, sender) -> None:
        self.sender = sender

    def push(self, version: int) -> None:
        self.sender.update_weights()
        self.pushed = version


class _ScalarLogger(Logger):
    """A torchrl-style logger (``log_scalar(name, value, step)``): its scalars, nothing else."""

    def __init__(self, logger) -> None:
        self.logger = logger

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self.logger.log_scalar(name, value, step=step)


def as_weight_sender(sender) -> WeightSender | None:
    """``sender`` as a :class:`WeightSender`: itself, or an object with ``update_weights()`` wrapped."""
    return sender if sender is None or isinstance(sender, WeightSender) else _UpdateWeightsSender(sender)


def as_logger(logger) -> Logger | None:
    """``logger`` as a :class:`Logger`: itself, or an object with ``log_scalar()`` wrapped."""
    return logger if logger is None or isinstance(logger, Logger) else _ScalarLogger(logger)
