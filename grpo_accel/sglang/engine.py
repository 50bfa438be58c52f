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

import concurrent.futures
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Mapping

from tensordict import TensorDict

from grpo_accel import batch
from grpo_accel.contracts import RolloutEngine
from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.rollout.sampling import batch_seeds, completion_keys
from grpo_accel.rules import setting
from grpo_accel.sglang import api

logger = logging.getLogger(__name__)

HEALTH_ANSWER_S = 60.0
"""How long one ``GET /health`` may take: SGLang runs a generation and answers 503 after ``HEALTH_CHECK_TIMEOUT``
(``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s by default; srt/entrypoints/http_server.py)."""


@dataclass
class _Completion:
    """One completion being generated, possibly over several requests (a continuation after an abort)."""

    prompt: list[int]
    params: dict  # sampling parameters, max_new_tokens = the whole budget
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: int | None = None
    first_version: int | None = None
    last_version: int = 0
    stalls: int = 0  # aborts in a row that brought no token while the server's weights stayed the same
    stall_version: int | None = None  # the server's weight version at the last of them

    @property
    def budget_left(self) -> int:
        return self.params["max_new_tokens"] - len(self.ids)


class SGLangEngine(RolloutEngine):
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

    remote = True
    """Generation runs in the servers' processes: the trainer's collectives (ZeRO-3's gathers) never wait for it,
    so collection may run in a background thread under any ZeRO stage."""

    def __init__(self, urls: list[str], tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, api_key: str | None = None, admin_api_key: str | None = None,
                 health_timeout_s: float = 300.0,
                 retries: int = 3, request_size: int = 64, request_timeout_s: float = 600.0, backoff_s: float = 0.5,
                 report_every_s: float = 30.0, stop_token_ids: tuple[int, ...] = (),
                 names: Mapping[str, str] | None = None) -> None:
        if not urls:
            raise ValueError(f"SGLangEngine: {setting(names, 'urls')} is empty; list the SGLang servers, e.g. "
                             "[http://host:30000].")
        self.clients = [HTTPClient(u, api_key, request_timeout_s, retries, backoff_s, setting(names, "api_key"))
                        for u in urls]
        self.admins = {c.url: HTTPClient(c.url, admin_api_key or api_key, 30.0, 0, backoff_s,
                                         setting(names, "admin_api_key")) for c in self.clients}
        self.stop_ids = {tokenizer.eos_token_id, *stop_token_ids}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.retries = retries
        self.stop_token_ids = [i for i in stop_token_ids if i != tokenizer.eos_token_id]
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

    def generate(self, prompt_ids: list[list[int]], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False) -> TensorDict:
        """Rollout TensorDict [len(prompt_ids) * group_size], the same keys as the embedded engine's. A
        completion whose context is full before it starts comes back empty with finish reason "length"."""
        keys = iter(completion_keys(batch_seeds(seeds, len(prompt_ids)), group_size))
        temperature = 0.0 if greedy else self.temperature
        completions = []
        for prompt in prompt_ids:
            budget = min(self.max_new_tokens, self.context_limit - len(prompt))
            for _ in range(group_size):
                params = api.sampling_params(max(budget, 0), temperature, self.top_p, self.top_k,
                                             seed=next(keys), stop_token_ids=self.stop_token_ids)
                full = batch.FINISH_LENGTH if budget <= 0 else None  # no room left for a token
                completions.append(_Completion(list(prompt), params, finish=full))
        self._run([c for c in completions if c.finish is None])
        return self._to_rollout(completions)

    # -- requests ------------------------------------------------------------------------------------------

    def _run(self, completions: list[_Completion]) -> None:
        """Generate ``completions``: contiguous shares per server, requests of at most ``request_size``, all at
        once; a line every ``report_every_s`` while some are outstanding."""
        self._wait_healthy()
        n = len(self.clients)
        bounds = [len(completions) * i // n for i in range(n + 1)]
        requests = [(client, completions[a + k : min(a + k + self.request_size, b)])
                    for client, a, b in zip(self.clients, bounds, bounds[1:]) for k in range(0, b - a, self.request_size)]
        if not requests:
            return
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(min(64, len(requests)), thread_name_prefix="sglang") as pool:
            futures = {pool.submit(self._complete, client, part): (client, part) for client, part in requests}
            pending = set(futures)
            while pending:
                done, pending = concurrent.futures.wait(pending, timeout=self.report_every_s,
                                                        return_when=concurrent.futures.FIRST_EXCEPTION)
                for future in done:
                    future.result()  # a request that failed after its retries fails the batch, naming it
                if pending:
                    self._report(start, [futures[f] for f in pending], len(requests))

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

    def _report(self, start: float, outstanding: list[tuple[HTTPClient, list[_Completion]]], total: int) -> None:
        per_server: dict[str, list[int]] = {}
        for client, part in outstanding:
            per_server.setdefault(client.url, []).append(sum(c.finish is None for c in part))
        logger.info("SGLang: %d of %d requests outstanding after %.0f s: %s", len(outstanding), total,
                    time.monotonic() - start, "; ".join(f"{url}: {len(n)} requests, {sum(n)} completions"
                                                        for url, n in per_server.items()))

    def _complete(self, client: HTTPClient, part: list[_Completion]) -> None:
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
            try:
                items = client.post(*request, retries=0)
            except ServerError as exc:
                failures += 1
                if exc.status is not None and exc.status < 500:
                    raise
                self._abort(client, rids)  # a timed-out request would go on generating for nobody
                if failures > self.retries:
                    raise
                logger.warning("%s/generate failed (%s); its %d completions aborted there and sent again, retry "
                               "%d/%d", client.url, exc, len(todo), failures, self.retries)
                time.sleep(client.backoff_s * 2 ** (failures - 1))
                continue
            failures = 0
            items = items if isinstance(items, list) else [items]
            for c, item in zip(todo, items):
                self._take(client, c, item, version)
            stalled = [(c, item) for c, item in zip(todo, items) if c.finish is None and not item["output_ids"]]
            todo = [c for c in todo if c.finish is None]
            stalls = max((c.stalls for c, _ in stalled), default=0)
            if stalls > 1:  # aborted again under the same weights: not a push; back off before sending again
                logger.warning("%s aborted %d requests before they generated (%s); retry %d/%d", client.url,
                               len(stalled), stalled[0][1]["meta_info"]["finish_reason"].get("message"), stalls - 1,
                               self.retries)
                time.sleep(client.backoff_s * 2 ** (stalls - 2))

    def _abort(self, client: HTTPClient, rids: list[str]) -> None:
        """``/abort_request`` for each rid, best effort (an unreachable server aborts nothing)."""
        admin = self.admins[client.url]
        for rid in rids:
            try:
                admin.post(*api.abort_request(rid))
            except ServerError as exc:
                logger.warning("%s: could not abort request %s (%s)", client.url, rid, exc)
                return

    def _take(self, client: HTTPClient, c: _Completion, item: dict, version: int | None) -> None:
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
        if drew:
            c.first_version = min(drew) if c.first_version is None else c.first_version
            c.last_version = max(c.last_version, *drew)
        elif c.first_version is None:  # no token yet: the row is of the weights the server answered with
            c.last_version = max(c.last_version, served)
        reason = meta["finish_reason"]
        if reason["type"] != "abort":
            # SGLang checks the length before the stop token (Req.check_finished): a completion whose last
            # token is a stop token stopped, whatever the reason says
            stopped = reason["type"] == "stop" or (c.ids and c.ids[-1] in self.stop_ids)
            c.finish = batch.FINISH_STOP if stopped else batch.FINISH_REASONS[reason["type"]]
        elif c.budget_left <= 0:
            c.finish = batch.FINISH_LENGTH
        elif ids or served != c.stall_version:  # a token, or a push came between: the queue at work
            c.stalls, c.stall_version = (0, None) if ids else (1, served)
        else:
            c.stalls += 1
            if c.stalls > self.retries:
                raise ServerError(f"{client.url}: /generate kept aborting without generating ({reason.get('message')}"
                                  f", status {reason.get('status_code')}) after {self.retries} retries.")

    def _to_rollout(self, completions: list[_Completion]) -> TensorDict:
        first = [c.last_version if c.first_version is None else c.first_version for c in completions]
        return batch.make_rollout(prompts=[c.prompt for c in completions], completions=[c.ids for c in completions],
                                  engine_logprobs=[c.logprobs for c in completions],
                                  finish_reason=[c.finish for c in completions], weight_version=first,
                                  weight_version_last=[max(c.last_version, f) for c, f in zip(completions, first)],
                                  pad_id=self.pad_id)
