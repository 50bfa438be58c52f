"""What a run leaves behind: its output folder (``folder.py``: the lock that names its holder, where a run starts,
an earlier run's outputs), checkpoints exported as Hugging Face model folders (``export.py``) and the background
upload of them to the Hub (``hub.py``)."""
