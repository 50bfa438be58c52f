"""What a run reports: the reporter the trainer calls (``reporter.py``), the scalars and samples of a batch
(``metrics.py``), TensorBoard's event files written and read (``event_files.py``), the trackers of
``trainer.report_to`` behind one logger (``trackers.py``), held-out evaluation as a hook (``evaluation.py``) and
runs' curves drawn from their event files (``report.py``, for ``grpo-accel report``)."""
