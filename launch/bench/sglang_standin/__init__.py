"""The SGLang stand-in: a loopback server for a given SGLang release, built from that release's own code and
source, for the tests (a real server needs a GPU). ``python launch/bench/sglang_standin --help`` runs it.

- ``source.py`` fetches each release's wheel and reads it (routes, request classes, the group join), with the
  facts read from its text in ``facts.py``;
- ``server.py`` is the HTTP server: routes, auth and validation as the release has them;
- ``tokenizer.py`` its tokenizer manager (pause, abort, health), ``scheduler.py`` its schedulers (a KV pool, a
  waiting queue, dp ranks) with ``kv.py``'s shared decode, ``weights.py`` its weight updates and tp ranks;
- ``processes.py`` starts stand-ins for the tests and talks to their test-control routes.
"""
