"""Shared by sglang/ and vllm/.

Rollouts from inference servers over HTTP, whatever the server (:class:`ServerEngine`): each prompt's budget
fitted to the servers' context, completions spread over the servers in contiguous shares and sent as requests all
at once, a line while some are outstanding, one try of a request (retried after a 5xx, an unreachable server or a
timeout, aborted on the server first), what an answer's finish reason means (finished, or aborted and continued),
and the rows built from what came back. An engine brings its sampling parameters, how a share is cut into requests
and how one request is made and read (``_sampling``, ``_requests``, ``_complete``).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

from tensordict import TensorDict

from grpo_accel import batch
from grpo_accel.contracts import RolloutEngine
from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.rollout.sampling import batch_seeds, completion_keys

logger = logging.getLogger(__name__)


@dataclass
class Completion:
    """One completion being generated, possibly over several requests (a continuation after an abort)."""

    prompt: list[int]
    budget: int  # new tokens, the whole completion
    params: dict  # the engine's sampling parameters, without the budget
    key: int = 0  # its random stream (completion_keys)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: int | None = None
    first_version: int | None = None
    last_version: int = 0
    stalls: int = 0  # aborts in a row that brought no token while the server's weights stayed the same
    stall_version: int | None = None  # the server's weight version at the last of them

    @property
    def budget_left(self) -> int:
        return self.budget - len(self.ids)

    def took(self, versions: list[int], served: int) -> None:
        """Record the weight versions that drew its new tokens (``versions``; none: no token came), or, before
        its first token, the version of the server that answered."""
        if versions:
            self.first_version = min(versions) if self.first_version is None else self.first_version
            self.last_version = max(self.last_version, *versions)
        elif self.first_version is None:
            self.last_version = max(self.last_version, served)


class ServerEngine(RolloutEngine):
    """A :class:`~grpo_accel.contracts.RolloutEngine` over inference servers; subclasses set ``clients`` (one
    :class:`~grpo_accel.http.HTTPClient` per server), ``pad_id``, ``stop_ids``, the sampling settings,
    ``retries``, ``request_size``, ``report_every_s`` and ``context_limit`` (the ids through ``_take_ids``), and implement ``_sampling`` and
    ``_complete`` (``_requests`` and ``_wait_healthy`` where they differ)."""

    remote = True
    """Generation runs in the servers' processes: the trainer's collectives (ZeRO-3's gathers) never wait for it,
    so collection may run in a background thread under any ZeRO stage."""
    label = "server"  # what the progress line calls the servers
    clients: list[HTTPClient]
    stop_ids: set[int]  # the ids that end a completion
    retries: int = 3
    top_p: float = 1.0
    top_k: int = 0
    request_size: int = 64
    report_every_s: float = 30.0

    def _take_ids(self, tokenizer, stop_token_ids: tuple[int, ...]) -> None:
        """``pad_id``, ``stop_ids`` (EOS and ``stop_token_ids``) and the ``stop_token_ids`` sent besides EOS."""
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id, *stop_token_ids}
        self.stop_token_ids = [i for i in stop_token_ids if i != tokenizer.eos_token_id]

    def generate(self, prompt_ids: list[list[int]], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False) -> TensorDict:
        """Rollout TensorDict [len(prompt_ids) * group_size], the same keys as the embedded engine's. A
        completion whose context is full before it starts comes back empty with finish reason "length"."""
        keys = iter(completion_keys(batch_seeds(seeds, len(prompt_ids)), group_size))
        temperature = 0.0 if greedy else self.temperature
        completions = []
        for prompt in prompt_ids:
            budget = max(min(self.max_new_tokens, self.context_limit - len(prompt)), 0)
            for _ in range(group_size):
                key = next(keys)
                completions.append(Completion(list(prompt), budget, self._sampling(temperature, key), key,
                                              finish=batch.FINISH_LENGTH if budget == 0 else None))
        self._run([c for c in completions if c.finish is None])
        return self._to_rollout(completions)

    def _sampling(self, temperature: float, key: int) -> dict:
        """The engine's sampling parameters of one completion drawing with ``key``."""
        raise NotImplementedError

    def _requests(self, share: list[Completion]) -> list[list[Completion]]:
        """One server's share cut into requests: of at most ``request_size`` completions."""
        return [share[k : k + self.request_size] for k in range(0, len(share), self.request_size)]

    def _complete(self, client: HTTPClient, part: list[Completion]) -> None:
        """Generate ``part`` on ``client``'s server until every completion finished (retries included)."""
        raise NotImplementedError

    def _wait_healthy(self) -> None:
        """Before the first generation: every server generates."""

    def _attempt(self, client: HTTPClient, request: tuple[str, dict], abort, failures: int, completions: int):
        """One try of ``request`` after ``failures`` failed ones: the server's answer, or None after a failure
        that leaves a retry (5xx, unreachable, timed out: ``abort()`` first, so that nothing goes on generating for
        nobody, then a backoff). A 4xx, or a failure past ``retries``, raises."""
        try:
            return client.post(*request, retries=0)
        except ServerError as exc:
            if exc.status is not None and exc.status < 500:
                raise
            abort()
            if failures + 1 > self.retries:
                raise
            logger.warning("%s%s failed (%s); its %d completions aborted there and sent again, retry %d/%d",
                           client.url, request[0], exc, completions, failures + 1, self.retries)
            time.sleep(client.backoff_s * 2**failures)
            return None

    def _settle(self, client: HTTPClient, c: Completion, reason: str, got: bool, served: int, path: str,
                why: str = "") -> None:
        """A completion after an answer with finish ``reason`` (stop, length, abort), ``got`` tokens or not, from
        a server at version ``served``: finished, or left to continue. An abort that brought nothing while the
        server's weights stayed the same counts against ``retries`` (one a push caused is the pause at work)."""
        if reason != "abort":
            # a server may check the length before the stop token (SGLang's Req.check_finished): a completion
            # whose last token is a stop token stopped, whatever the reason says
            stopped = reason == "stop" or (c.ids and c.ids[-1] in self.stop_ids)
            c.finish = batch.FINISH_STOP if stopped else batch.FINISH_REASONS[reason]
        elif c.budget_left <= 0:
            c.finish = batch.FINISH_LENGTH
        elif got or served != c.stall_version:
            c.stalls, c.stall_version = (0, None) if got else (1, served)
        else:
            c.stalls += 1
            if c.stalls > self.retries:
                raise ServerError(f"{client.url}: {path} kept aborting without generating{why} after {self.retries} "
                                  "retries.")

    def _back_off(self, client: HTTPClient, stalls: int, count: int, why: str = "") -> None:
        """Requests aborted again under the same weights (``stalls`` times in a row): not a push; wait before
        sending them again."""
        if stalls > 1:
            logger.warning("%s aborted %d requests before they generated%s; retry %d/%d", client.url, count, why,
                           stalls - 1, self.retries)
            time.sleep(client.backoff_s * 2 ** (stalls - 2))

    def _run(self, completions: list[Completion]) -> None:
        """Generate ``completions``: contiguous shares per server, requests all at once; a line every
        ``report_every_s`` while some are outstanding."""
        self._wait_healthy()
        n = len(self.clients)
        bounds = [len(completions) * i // n for i in range(n + 1)]
        requests = [(client, part) for client, a, b in zip(self.clients, bounds, bounds[1:])
                    for part in self._requests(completions[a:b])]
        if not requests:
            return
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(min(64, len(requests)), thread_name_prefix=self.label) as pool:
            futures = {pool.submit(self._complete, client, part): (client, part) for client, part in requests}
            pending = set(futures)
            while pending:
                done, pending = concurrent.futures.wait(pending, timeout=self.report_every_s,
                                                        return_when=concurrent.futures.FIRST_EXCEPTION)
                for future in done:
                    future.result()  # a request that failed after its retries fails the batch, naming it
                if pending:
                    self._report(start, [futures[f] for f in pending], len(requests))

    def _report(self, start: float, outstanding: list[tuple[HTTPClient, list[Completion]]], total: int) -> None:
        per_server: dict[str, list[int]] = {}
        for client, part in outstanding:
            per_server.setdefault(client.url, []).append(sum(c.finish is None for c in part))
        logger.info("%s: %d of %d requests outstanding after %.0f s: %s", self.label, len(outstanding), total,
                    time.monotonic() - start, "; ".join(f"{url}: {len(n)} requests, {sum(n)} completions"
                                                        for url, n in per_server.items()))

    def _to_rollout(self, completions: list[Completion]) -> TensorDict:
        first = [c.last_version if c.first_version is None else c.first_version for c in completions]
        return batch.make_rollout(prompts=[c.prompt for c in completions], completions=[c.ids for c in completions],
                                  engine_logprobs=[c.logprobs for c in completions],
                                  finish_reason=[c.finish for c in completions], weight_version=first,
                                  weight_version_last=[max(c.last_version, f) for c, f in zip(completions, first)],
                                  pad_id=self.pad_id)
