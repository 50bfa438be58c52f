"""The trainer's room: ``GRPOTrainer`` (``loop.py``: the loop under ``accelerate.Accelerator``, its steps in order)
and its private parts: argument checks (``args.py``), hook stages (``hooks.py``), the mixed-precision optimization
stepper (``stepper.py``), the replay buffer (``buffer.py``) and saving / loading a run (``checkpointer.py``).
"""
from grpo_accel.trainer.loop import GRPOTrainer

__all__ = ["GRPOTrainer"]
