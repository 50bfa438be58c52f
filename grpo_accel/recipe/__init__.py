"""The recipe: a YAML config becomes a run. The config's schema (``schema.py``) and loading (``loading.py``),
the builders that turn it into parts and wire them into a trainer (``build.py``), and the run folder
(``run_folder.py``: its lock, where a run starts, an earlier run's outputs). ``launch/train.py`` drives it.

Components never import this package: they raise their own errors with their own argument names, and the
recipe says which config key was meant.
"""
