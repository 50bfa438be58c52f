"""MLflow hidden from a process the tests start (tests/conftest.py puts this folder on its PYTHONPATH).

DeepSpeed's import takes MLflow in whenever it is installed (its autotuner's ``import mlflow``), in the launcher of
every ``accelerate launch`` under DeepSpeed and in every rank: 1.3 s each on the test machine, 2.5 s of a 13 s
one-batch ZeRO-2 launch. Only the runs that report to MLflow use it; they take this folder off their PYTHONPATH
(tests/helpers/tracker_stores.py). ``import mlflow`` then fails as if it were not installed, and
``importlib.util.find_spec("mlflow")`` (Accelerate's check) answers None.
"""
import sys

sys.modules.setdefault("mlflow", None)
