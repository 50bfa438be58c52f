"""The collector (prompts -> rollouts -> rewards -> advantages), keyed sampling and the sampling keys both engines
use, and multi-turn episodes (asynchronous collection is the trainer's: :mod:`grpo_accel.trainer.background`).
The engines have rooms of their own: :mod:`grpo_accel.embedded`,
:mod:`grpo_accel.sglang`."""
