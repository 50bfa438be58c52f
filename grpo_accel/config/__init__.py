"""The config language: what a run's settings are and how they are read. The schema owns every config class
(``schema.py``: the run and the model, data, loss, optimizer and trainer sections; ``rollout_schema.py``: rollout,
rewards, weight sync; ``outputs.py``: evaluation, checkpoints, the Hub upload), their checks and ``ConfigError``
(``checks.py``), loading from defaults, a YAML file and ``key=value`` overrides, and the comparison a resume makes
(``loading.py``), settings that follow the model and the hardware (``defaults.py``), secrets (``secrets.py``) and
the configuration reference (``reference.py``). TRL's names and ``trl grpo`` config files are translated in
:mod:`grpo_accel.config.trl`.

Components never import this package: they raise their own errors with their own argument names, and the recipe
(:mod:`grpo_accel.recipe`) says which config key was meant.
"""
