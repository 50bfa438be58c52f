"""TRL's config language translated: every field of TRL 1.16's ``GRPOConfig``, ``ScriptArguments`` and
``ModelConfig`` with what becomes of it here (``fields.py``), TRL's batch arithmetic and the translation's pieces
(``rules.py``), and a ``trl grpo`` config file run as it is (``translate.py``)."""
