"""The recipe: a YAML config becomes a run. The config's schema (``schema.py``, ``rollout_schema.py``) and its
checks (``checks.py``), loading and resume comparison (``loading.py``), settings that follow the model and the
hardware (``defaults.py``), secrets (``secrets.py``), TRL's names and config files (``trl_fields.py``,
``trl_config.py``), the configuration reference (``reference.py``), the dataset's rows (``dataset.py``), the parts
(``parts.py``) and the wiring into a trainer (``build.py``), the run folder (``run_folder.py``: its lock, where a
run starts, an earlier run's outputs) and export (``export.py``). ``grpo_accel.cli.train`` drives it.

Components never import this package: they raise their own errors with their own argument names, and the
recipe says which config key was meant.
"""
