"""What a run reports: the reporter the trainer calls (``reporter.py``), the scalars of a batch (``metrics.py``),
the TensorBoard logger and readers (``tracking.py``) and held-out evaluation as a hook (``evaluation.py``)."""
