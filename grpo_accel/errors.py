"""Shared by checkpoint.py, cli/, config/, data/, distributed/, http.py, reporting/, rewards/, rollout/, run/,
shipped.py and weight_sync/.

The base class of the errors a user fixes: each message names the setting, file or function, the value and the
fix, so the launcher shows it as one line (exit code 2) instead of a traceback."""


class UserError(Exception):
    """A mistake in what the user gave (a setting, a file, a function, a server): one line says what to change."""
