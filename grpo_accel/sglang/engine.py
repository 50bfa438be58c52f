"""Rollouts from SGLang servers over HTTP (``POST /generate`` with ``input_ids``), the trainer side only.

Each prompt is repeated ``group_size`` times with its own ``sampling_seed`` (completion j of a prompt with seed
s). SGLang honours the seed only on a server started with ``--enable-deterministic-inference``; without it the
rollouts are not reproducible, and the engine says so once at start. Completions are spread over the servers
(one per engine replica) in contiguous shares, each share cut into requests of at most ``request_size``
completions, all sent at once; engine logprobs are SGLang's ``output_token_logprobs``,
``log_softmax(logits / temperature)`` before top-k/top-p, exactly what the loss divides by the temperature for.

Partial rollouts: a weight push may land while a completion is generated. Pushed with ``retract`` (the default,
see :mod:`grpo_accel.sglang.servers`), the server keeps it and finishes it with the new weights; pushed with
``abort``, it comes back cut short and is continued here from prompt + what it had, with the budget left; one
still waiting in the server's queue comes back with nothing and is sent again. Either way every token keeps the
logprob of the weights that drew it, and the row records the oldest version and the newest
(``weight_version_last``): from the spans each answer carries (``meta_info.weight_versions``, 0.5.19+), else from
the server's version when the request was sent and when it answered.

Only an abort that brought nothing while the server's weights stayed the same counts against ``retries``: one a
push caused (the version moved) is the scheduler's queue at work, not a failure. A request that fails or times
out is aborted on the server by its ``rid`` before it is sent again, so that nothing goes on generating for nobody.
"""
from __future__ import annotations

import logging
import uuid
from typing import Mapping

from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.rules import setting
from grpo_accel.server_rollouts import Completion, ServerEngine
from grpo_accel.sglang import api

logger = logging.getLogger(__name__)

HEALTH_ANSWER_S = 60.0
"""How long one ``GET /health`` may take: SGLang runs a generation and answers 503 after ``HEALTH_CHECK_TIMEOUT``
(``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s by default; srt/entrypoints/http_server.py)."""


class SGLangEngine(ServerEngine):
    """A :class:`~grpo_accel.contracts.RolloutEngine` over SGLang servers.

    Args:
        urls: one URL per engine replica (``http://host:port``).
        tokenizer: gives pad/eos ids (prompts are already token ids).
        max_new_tokens, temperature, top_p, top_k: sampling parameters sent to SGLang.
        api_key: sent as ``Authorization: Bearer <key>`` (the server's ``--api-key``).
        admin_api_key: the servers' ``--admin-api-key``, for ``/abort_request`` (else ``api_key``).
        health_timeout_s: at start, wait this long for every server's ``/server_info`` (its release, checked
            against the supported range; the answer also proves the key), then read its context length from
            ``/v1/models``; before the first generation, this long again for every server's ``/health``. SGLang's
            health check is a one-token generation, which a server left paused or with its memory released (by a
            trainer killed before its next push) never runs: the weight sender brings such servers back first
            (:class:`~grpo_accel.sglang.sender.SGLangSender`), so the engine waits for health only then.
        retries: attempts after the first for 5xx answers, unreachable servers and timeouts (each request on
            its own, aborted on the server first), and for aborts that brought no new token while the server's
            weights stayed the same.
        request_size: completions per HTTP request at most; a server's share goes out as several at once.
        request_timeout_s: seconds one request may take before it is sent again (a retry).
        report_every_s: while requests are outstanding, a line this often says which, on which server.
        stop_token_ids: ids that end a completion besides the tokenizer's EOS (the model's generation config's:
            :func:`grpo_accel.batch.stop_token_ids`), sent with every request.
        names: what messages call the settings they name (:func:`grpo_accel.rules.setting`; the recipe passes
            the config's keys).

    Example:
        >>> engine = SGLangEngine(["http://10.0.0.2:30000"], tokenizer, max_new_tokens=512)
        >>> rollout = engine.generate([[1, 2, 3]], group_size=8, seeds=[7])
    """

    label = "SGLang"

    def __init__(self, urls: list[str], tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, api_key: str | None = None, admin_api_key: str | None = None,
                 health_timeout_s: float = 300.0,
                 retries: int = 3, request_size: int = 64, request_timeout_s: float = 600.0, backoff_s: float = 0.5,
                 report_every_s: float = 30.0, stop_token_ids: tuple[int, ...] = (),
                 names: Mapping[str, str] | None = None) -> None:
        if not urls:
            raise ValueError(f"SGLangEngine: {setting(names, 'urls')} is empty; list the SGLang servers, e.g. "
                             "[http://host:30000].")
        self.clients = [HTTPClient(u, api_key, request_timeout_s, retries, backoff_s, setting(names, "api_key"),
                                   "SGLang server") for u in urls]
        self.admins = {c.url: HTTPClient(c.url, admin_api_key or api_key, 30.0, 0, backoff_s,
                                         setting(names, "admin_api_key")) for c in self.clients}
        self._take_ids(tokenizer, stop_token_ids)
        self.retries = retries
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.request_size, self.report_every_s = request_size, report_every_s
        self.health_timeout_s, self.names, self._healthy = health_timeout_s, names, False
        self.servers = [api.ServerInfo.from_json(c.url, c.wait_for("/server_info", health_timeout_s, names=names))
                        for c in self.clients]  # answered by a paused server too
        self._spans = {i.url for i in self.servers if i.reports_token_versions}  # per-token weight versions
        for info in self.servers:
            info.check_supported()
        contexts = [api.read_context_length(c) for c in self.clients]
        self.context_length = min(contexts)  # the shortest of the servers' contexts
        inputs = [i.max_req_input_len for i in self.servers if i.max_req_input_len]
        self.max_req_input_len = min(inputs) if inputs else None
        self.description = "SGLang servers: " + ", ".join(
            f"{c.url} (SGLang {'.'.join(map(str, i.version))}, tp {i.tp_size}, dp ranks {i.dp_ranks}, context {n}, "
            f"input limit {i.max_req_input_len})" for c, i, n in zip(self.clients, self.servers, contexts))
        random = [i.url for i in self.servers if not i.deterministic]
        if random:
            logger.warning("sampling_seed is ignored by %s (started without --enable-deterministic-inference): "
                           "rollouts are not reproducible. Start the servers with that flag to make them so.",
                           ", ".join(random))

    @property
    def context_limit(self) -> int:
        """The most prompt + completion tokens one sequence may hold on every server: one less than the context
        (0.5.9 refuses a request that fills it; 0.5.23 would take one more), and at most the scheduler's
        ``max_req_input_len``, so that every prefix of it can be sent again (an aborted completion's
        continuation, an episode's next turn) and no budget is cut short without a word."""
        limit = self.context_length - 1
        return min(limit, self.max_req_input_len) if self.max_req_input_len else limit

    def _sampling(self, temperature: float, key: int) -> dict:
        return api.sampling_params(self.max_new_tokens, temperature, self.top_p, self.top_k, seed=key,
                                   stop_token_ids=self.stop_token_ids)  # max_new_tokens: each request's budget left

    # -- requests ------------------------------------------------------------------------------------------

    def _wait_healthy(self) -> None:
        """Before the first generation, every server's ``/health`` answers 200. One that answers ``/server_info``
        but not ``/health`` is up and does not generate: the error says why and what brings it back."""
        if self._healthy:
            return
        for client in self.clients:
            try:  # SGLang answers within HEALTH_CHECK_TIMEOUT (20 s by default), whatever request_timeout_s is
                client.wait_healthy(self.health_timeout_s, names=self.names, request_timeout_s=HEALTH_ANSWER_S)
            except ServerError as exc:
                raise ServerError(
                    f"{exc} It answered /server_info, so it is up but does not generate: it is paused, or has memory "
                    "released (--enable-memory-saver), as a trainer killed between a pause or a release and its next "
                    "push leaves it. A colocated run started again on its output_dir brings it back from its record "
                    "(sglang_memory.json); otherwise restart the server.", exc.status) from None
        self._healthy = True

    def _complete(self, client: HTTPClient, part: list[Completion]) -> None:
        """Send ``part`` as one request; what comes back aborted (a push paused the server with ``abort``) is
        continued from prompt + its tokens so far with the budget left, until every completion finished. A request
        that fails (5xx, unreachable, timed out) is aborted by its rids and sent again, ``retries`` times at most."""
        todo, failures = part, 0
        while todo:
            # no token of this request is older; not needed where the answers carry per-token versions
            version = None if client.url in self._spans else api.read_weight_version(client)
            rids = [uuid.uuid4().hex for _ in todo]
            request = api.generate([c.prompt + c.ids for c in todo],
                                   [{**c.params, "max_new_tokens": c.budget_left} for c in todo], rids)
            items = self._attempt(client, request, lambda: self._abort(client, rids), failures, len(todo))
            if items is None:
                failures += 1
                continue
            failures = 0
            items = items if isinstance(items, list) else [items]
            for c, item in zip(todo, items):
                self._take(client, c, item, version)
            stalled = [(c, item) for c, item in zip(todo, items) if c.finish is None and not item["output_ids"]]
            todo = [c for c in todo if c.finish is None]
            stalls = max((c.stalls for c, _ in stalled), default=0)
            if stalled:
                self._back_off(client, stalls, len(stalled),
                               f" ({stalled[0][1]['meta_info']['finish_reason'].get('message')})")

    def _abort(self, client: HTTPClient, rids: list[str]) -> None:
        """``/abort_request`` for each rid, best effort (an unreachable server aborts nothing)."""
        admin = self.admins[client.url]
        for rid in rids:
            try:
                admin.post(*api.abort_request(rid))
            except ServerError as exc:
                logger.warning("%s: could not abort request %s (%s)", client.url, rid, exc)
                return

    def _take(self, client: HTTPClient, c: Completion, item: dict, version: int | None) -> None:
        ids, meta = item["output_ids"], item["meta_info"]
        pairs = meta["output_token_logprobs"] if ids else []
        if [int(p[1]) for p in pairs] != list(ids):
            raise ServerError(f"request {meta.get('id')}: output_token_logprobs do not match output_ids; "
                              "the server must return logprobs for every generated token (return_logprob).")
        c.ids += list(ids)
        c.logprobs += [float(p[0]) for p in pairs]
        served = api.weight_version(meta.get("weight_version"))
        if "weight_versions" in meta:  # 0.5.19+: the version of every token, by span
            drew = [api.weight_version(s["version"]) for s in meta["weight_versions"] if s["end"] > s["start"]]
        else:
            drew = [v for v in (version, served) if v is not None] if ids else []
        c.took(drew, served)  # no token yet: the row is of the weights the server answered with
        reason = meta["finish_reason"]
        self._settle(client, c, reason["type"], bool(ids), served, "/generate",
                     f" ({reason.get('message')}, status {reason.get('status_code')})")
