"""An in-process GRPOTrainer on the built-in tiny model and task, for tests."""
import pytest
import torch

from grpo_accel.layout import BatchLayout
from grpo_accel.lora import trainable_parameters
from grpo_accel.loss import GRPOLoss
from grpo_accel.rewards import RewardSet, answer_match, format_match
from grpo_accel.rollout.collector import GRPOCollector
from grpo_accel.embedded.engine import EmbeddedEngine
from grpo_accel.tasks.addition import addition_rows
from grpo_accel.trainer import GRPOTrainer
from grpo_accel.embedded.sender import EmbeddedWeightSync


def reset_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


CLI_MODULES = {"train": "grpo_accel.cli.train", "reward_server": "grpo_accel.cli.reward_server"}
"""launch/ scripts whose code is the installed command's (launch/<script>.py is a thin script over the module)."""


def main_in_process(script: str, argv: list[str], **replaced) -> int:
    """``python launch/<script>.py *argv`` (or ``launch/bench/<script>.py``) in this process (a one-process run without the ~4 s of a launch's
    imports), with the script's attributes in ``replaced`` swapped for the call. The scripts set torch's threads
    from the cores and build an Accelerator, as a launched run does: both are restored after."""
    import importlib

    from launching import ROOT

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(ROOT / "launch"))
        patch.syspath_prepend(str(ROOT / "launch" / "bench"))  # the measuring tools
        module = importlib.import_module(CLI_MODULES.get(script, script))
        for name, value in replaced.items():
            patch.setattr(module, name, value)
        try:
            return module.main(argv)
        finally:
            torch.set_num_threads(threads)
            reset_accelerate_state()


def train_in_process(args: list[str]) -> int:
    """launch/train.py's ``main(args)`` in this process; its console set-up (logging format, warnings once) is
    left out so that pytest's capture stays."""
    return main_in_process("train", args, quiet_console=lambda: None)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    reset_accelerate_state()


class RecordingLoss(GRPOLoss):
    """GRPOLoss that keeps every forward's diagnostics."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = []

    def forward(self, td, normalizer=None):
        out = super().forward(td, normalizer)
        self.calls.append({k: float(out[k].detach()) for k in out.keys()})
        return out


def make_trainer(tokenizer, model, *, prompts=4, group=4, lr=3e-3, loss_kwargs=None, collector_seed=0, **kw):
    torch.manual_seed(0)
    engine = EmbeddedEngine(model, tokenizer, max_new_tokens=4)
    rewards = RewardSet({"answer_match": answer_match, "format_match": format_match}, {"format_match": 0.2})
    collector = GRPOCollector(engine, tokenizer, addition_rows(4)[0], rewards, layout=BatchLayout(prompts, group),
                              seed=collector_seed)
    loss = RecordingLoss(model, **(loss_kwargs or {}))
    args = dict(
        collector=collector, total_frames=prompts * group * 3, loss_module=loss,
        optimizer=torch.optim.AdamW(trainable_parameters(model), lr=lr),
        weight_sync_sender=EmbeddedWeightSync(engine), empty_replay_buffer_on_weight_update=True, seed=0,
    ) | kw
    return GRPOTrainer(**args)




def without_wall_times(history: list[dict]) -> list[dict]:
    """Logged scalars less the seconds under time/ (the collector's are logged always): what a seeded run
    repeats exactly."""
    return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in history]
