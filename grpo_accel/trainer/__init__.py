"""The trainer's room: ``GRPOTrainer`` (``loop.py``: the loop under ``accelerate.Accelerator``, its steps in order)
and its private parts: argument checks (``args.py``), hook stages (``hooks.py``), the mixed-precision optimization
stepper and the learning rate of each step (``stepper.py``), the replay buffer (``buffer.py``), saving / loading a
run (``checkpointer.py``; another process count or ZeRO stage through a checkpoint's portable form,
``portable.py``), asynchronous collection in a thread (``background.py``) and the arithmetic that makes an
optimizer step over micro-batches and processes take each unit once (``normalizer.py``). It reaches the objective
and the collector through :mod:`grpo_accel.contracts` alone.
"""
from grpo_accel.trainer.loop import GRPOTrainer

__all__ = ["GRPOTrainer"]
