"""The collector (prompts -> rollouts -> rewards -> advantages), keyed sampling and the sampling keys both engines
use, multi-turn episodes and async collection. The engines have rooms of their own: :mod:`grpo_accel.embedded`,
:mod:`grpo_accel.sglang`."""
