"""Rollouts from vLLM servers over HTTP (``POST /v1/completions`` with token-id prompts), the trainer side only.

The completions of one prompt go out as one request with ``n`` of them and the seed of the first: vLLM draws
sample j with seed + j (v1/engine/parallel_sampling.py), which is exactly completion j's key here
(:func:`grpo_accel.rollout.sampling.completion_keys`), so vLLM's rollouts are reproducible from the trainer's seed
and the same for any split of the prompts over servers. Engine logprobs are the sampled tokens' (``logprobs: 0``),
as the server's ``--logprobs-mode`` computes them; the engine refuses at start a mode whose logprobs are not what
the loss computes (:meth:`grpo_accel.vllm.api.ServerInfo.check_logprobs`).

Partial rollouts: a weight push pauses the servers with ``keep`` (the default: in-flight requests freeze and go on
with the new weights) or ``abort`` (they come back cut short, finish reason "abort", with their tokens and
logprobs, and are continued here one by one from prompt + what they had, with the budget left and their own key).
The versions a row records are the server's ``/weight_info`` when the request was sent and when it answered. A
request that fails or times out is aborted on the server by its id before it is sent again.
"""
from __future__ import annotations

import logging
import uuid
from typing import Mapping

from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.rules import setting
from grpo_accel.server_rollouts import Completion, ServerEngine
from grpo_accel.vllm import api

logger = logging.getLogger(__name__)


class VLLMEngine(ServerEngine):
    """A :class:`~grpo_accel.contracts.RolloutEngine` over vLLM servers started with ``VLLM_SERVER_DEV_MODE=1``.

    Args:
        urls: one URL per server (``http://host:port``).
        tokenizer: gives pad/eos ids (prompts are already token ids).
        max_new_tokens, temperature, top_p, top_k: sampling parameters.
        api_key: the servers' ``--api-key``, sent as ``Authorization: Bearer <key>``.
        health_timeout_s: at start, wait this long for every server's ``/health``, then read what it is
            (``/version``, ``/server_info``: its release, context and logprobs mode).
        retries: attempts after the first for 5xx answers, unreachable servers and timeouts (each request aborted
            on the server first), and for aborts that brought no token while the server's weights stayed the same.
        request_size: completions per request at most (one prompt's completions go out together).
        request_timeout_s: seconds one request may take before it is aborted and sent again.
        report_every_s: while requests are outstanding, a line this often says which, on which server.
        stop_token_ids: ids that end a completion besides the tokenizer's EOS.
        names: what messages call the settings they name (:func:`grpo_accel.rules.setting`).

    Example:
        >>> engine = VLLMEngine(["http://10.0.0.2:8000"], tokenizer, max_new_tokens=512)
        >>> rollout = engine.generate([[1, 2, 3]], group_size=8, seeds=[7])
    """

    label = "vLLM"

    def __init__(self, urls: list[str], tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, api_key: str | None = None, health_timeout_s: float = 300.0,
                 retries: int = 3, request_size: int = 64, request_timeout_s: float = 600.0, backoff_s: float = 0.5,
                 report_every_s: float = 30.0, stop_token_ids: tuple[int, ...] = (),
                 names: Mapping[str, str] | None = None) -> None:
        if not urls:
            raise ValueError(f"VLLMEngine: {setting(names, 'urls')} is empty; list the vLLM servers, e.g. "
                             "[http://host:8000].")
        key = setting(names, "api_key")
        self.clients = [HTTPClient(u, api_key, request_timeout_s, retries, backoff_s, key, "vLLM server") for u in urls]
        self.admins = {c.url: HTTPClient(c.url, api_key, 30.0, 0, backoff_s, key) for c in self.clients}
        self._take_ids(tokenizer, stop_token_ids)
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.retries, self.request_size, self.report_every_s = retries, request_size, report_every_s
        for client in self.clients:
            client.wait_healthy(health_timeout_s, names=names)
        self.servers = [api.read_server_info(c, health_timeout_s) for c in self.clients]
        for info in self.servers:
            info.check_supported()
            info.check_logprobs(temperature, top_p, top_k)
            info.check_prefill()
        self.clients[0].get("/v1/models", timeout_s=health_timeout_s)  # the key, checked once (vLLM guards /v1 only)
        # a prompt + max_tokens may fill the context; one less keeps every prefix of a sequence sendable again
        self.context_limit = min(i.max_model_len for i in self.servers) - 1
        self.description = "vLLM servers: " + ", ".join(
            f"{i.url} (vLLM {'.'.join(map(str, i.version))}, tp {i.tp_size}, dp {i.dp_size}, context "
            f"{i.max_model_len}, {i.logprobs_mode}, {i.dtype})" for i in self.servers)

    def _sampling(self, temperature: float, key: int) -> dict:
        """The request's seed is its first completion's key (``Completion.key``): not a parameter of its own."""
        return {"temperature": temperature, "top_p": self.top_p, "top_k": self.top_k,
                "stop_token_ids": self.stop_token_ids}

    def _requests(self, share: list[Completion]) -> list[list[Completion]]:
        """One request per prompt's run of completions (consecutive keys: vLLM's seed + j), at most
        ``request_size`` each."""
        parts: list[list[Completion]] = []
        for c in share:
            last = parts[-1][-1] if parts else None
            if last is None or c.prompt != last.prompt or c.key != last.key + 1 or len(parts[-1]) >= self.request_size:
                parts.append([c])
            else:
                parts[-1].append(c)
        return parts

    def _complete(self, client: HTTPClient, part: list[Completion]) -> None:
        """``part`` as one request (n = its size); what comes back aborted is continued one by one from prompt + its
        tokens with the budget left. A request that fails (5xx, unreachable, timed out) is aborted by its id and
        sent again, ``retries`` times at most."""
        todo, failures = [part], 0
        while todo:
            group = todo.pop(0)
            first, version = group[0], api.read_weight_version(client)
            rid = uuid.uuid4().hex
            request = api.completions(first.prompt + first.ids, len(group), first.budget_left, seed=first.key,
                                      request_id=rid, **first.params)
            answer = self._attempt(client, request, lambda: self._abort(client, rid), failures, len(group))
            if answer is None:
                failures += 1
                todo.insert(0, group)
                continue
            failures = 0
            served = api.read_weight_version(client)
            for c, choice in zip(group, sorted(answer["choices"], key=lambda choice: choice["index"])):
                self._take(client, c, choice, version, served)
            todo += [[c] for c in group if c.finish is None]  # continued one by one, each with its own key
            stalled = [c for c in group if c.finish is None and c.stalls]
            self._back_off(client, max((c.stalls for c in stalled), default=0), len(stalled))

    def _abort(self, client: HTTPClient, rid: str) -> None:
        """``/abort_requests`` for the request, best effort (an unreachable server aborts nothing)."""
        try:
            self.admins[client.url].post(*api.abort_requests([api.engine_request_id(rid)]))
        except ServerError as exc:
            logger.warning("%s: could not abort request %s (%s)", client.url, rid, exc)

    def _take(self, client: HTTPClient, c: Completion, choice: dict, version: int, served: int) -> None:
        ids = list(choice.get("token_ids") or [])
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(logprobs) != len(ids):
            raise ServerError(f"{client.url}: /v1/completions returned {len(logprobs)} logprobs for {len(ids)} tokens; "
                              "the server must return the logprob of every sampled token (logprobs: 0).")
        c.ids += ids
        c.logprobs += [float(x) for x in logprobs]
        c.took(sorted({version, served}) if ids else [], served)
        self._settle(client, c, choice.get("finish_reason") or "length", bool(ids), served, "/v1/completions")
