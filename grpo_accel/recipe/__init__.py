"""The recipe: a checked config (:mod:`grpo_accel.config`) becomes a ready trainer. The parts its sections describe
(``parts.py``: tokenizer, model, reference, rows, rewards, environment, engine) and their wiring into a
:class:`~grpo_accel.trainer.GRPOTrainer` (``build.py``: the run's one ``BatchLayout``, ``build_trainer``).
``grpo_accel.cli.train`` drives it; what the run leaves behind is :mod:`grpo_accel.run`.

Components never import this package: they raise their own errors with their own argument names, and the
recipe says which config key was meant.
"""
