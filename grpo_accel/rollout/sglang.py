"""Rollouts from SGLang servers over HTTP (``POST /generate`` with ``input_ids``), the trainer side only.

Each prompt is repeated ``group_size`` times with its own ``sampling_seed`` (completion j of a prompt with seed
s). SGLang honours the seed only on a server started with ``--enable-deterministic-inference``; without it the
rollouts are not reproducible, and the engine says so once at start. Prompts are spread over the servers (one
per engine replica) in contiguous chunks, sent concurrently; engine logprobs are SGLang's
``output_token_logprobs``, ``log_softmax(logits / temperature)`` before top-k/top-p, exactly what the loss
divides by the temperature for.
"""
from __future__ import annotations

import concurrent.futures
import logging

import torch
from tensordict import TensorDict

from grpo_accel import batch as K
from grpo_accel import sglang_api as api
from grpo_accel.http import HTTPClient, ServerError

logger = logging.getLogger(__name__)


class SGLangEngine:
    """The rollout engine protocol (``generate``, ``weight_version``, ``pad_id``) over SGLang servers.

    Args:
        urls: one URL per engine replica (``http://host:port``).
        tokenizer: gives pad/eos ids (prompts are already token ids).
        max_new_tokens, temperature, top_p, top_k: sampling parameters sent to SGLang.
        api_key: sent as ``Authorization: Bearer <key>`` (the server's ``--api-key``).
        health_timeout_s: wait this long for ``/health`` on every server at start; then each server's release
            is read from ``/server_info`` (which also proves the key) and checked against the supported range.
        retries: attempts after the first for 5xx answers, unreachable servers and aborted requests.

    Example:
        >>> engine = SGLangEngine(["http://10.0.0.2:30000"], tokenizer, max_new_tokens=512)
        >>> rollout = engine.generate([[1, 2, 3]], group_size=8, seeds=[7])
    """

    def __init__(self, urls: list[str], tokenizer, *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, api_key: str | None = None, health_timeout_s: float = 300.0,
                 retries: int = 3, timeout_s: float = 600.0, backoff_s: float = 0.5) -> None:
        if not urls:
            raise ValueError("SGLangEngine: rollout.urls is empty; list the SGLang servers, e.g. [http://host:30000].")
        self.clients = [HTTPClient(u, api_key, timeout_s, retries, backoff_s) for u in urls]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id, self.retries = tokenizer.eos_token_id, retries
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.weight_version = 0
        for client in self.clients:
            client.wait_healthy(health_timeout_s)
        self.servers = [api.read_server_info(c) for c in self.clients]
        for info in self.servers:
            info.check_supported()
        random = [i.url for i in self.servers if not i.deterministic]
        if random:
            logger.warning("sampling_seed is ignored by %s (started without --enable-deterministic-inference): "
                           "rollouts are not reproducible. Start the servers with that flag to make them so.",
                           ", ".join(random))

    def generate(self, prompt_ids: list[list[int]], group_size: int, seeds: list[int] | None = None,
                 greedy: bool = False) -> TensorDict:
        """Rollout TensorDict [len(prompt_ids) * group_size], the same keys as the embedded engine's."""
        if seeds is None:
            seeds = torch.randint(0, 2**56, (len(prompt_ids),)).tolist()
        n = len(self.clients)
        bounds = [len(prompt_ids) * i // n for i in range(n + 1)]  # contiguous chunk per server
        jobs = [(c, prompt_ids[a:b], seeds[a:b]) for c, a, b in zip(self.clients, bounds, bounds[1:]) if b > a]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            parts = list(pool.map(lambda job: self._request(*job, group_size, greedy), jobs))
        items = [item for part in parts for item in part]
        return self._to_rollout([p for p in prompt_ids for _ in range(group_size)], items)

    def _request(self, client: HTTPClient, prompts: list[list[int]], seeds: list[int], group_size: int,
                 greedy: bool) -> list[dict]:
        temperature = 0.0 if greedy else self.temperature
        params = [api.sampling_params(self.max_new_tokens, temperature, self.top_p, self.top_k,
                                      seed=(seed * group_size + j) % 2**31)
                  for seed in seeds for j in range(group_size)]
        request = api.generate([p for p in prompts for _ in range(group_size)], params)
        for attempt in range(self.retries + 1):
            items = client.post(*request)
            items = items if isinstance(items, list) else [items]
            aborted = [it["meta_info"]["finish_reason"] for it in items if it["meta_info"]["finish_reason"]["type"] == "abort"]
            if not aborted:
                return items
            logger.warning("%s aborted %d requests (%s); retry %d/%d", client.url, len(aborted),
                           aborted[0].get("message"), attempt + 1, self.retries)
        raise ServerError(f"{client.url}: /generate kept aborting ({aborted[0].get('message')}, "
                          f"status {aborted[0].get('status_code')}) after {self.retries} retries.")

    def _to_rollout(self, prompts: list[list[int]], items: list[dict]) -> TensorDict:
        completions, logprobs, finish, versions = [], [], [], []
        for item in items:
            ids, meta = item["output_ids"], item["meta_info"]
            pairs = meta["output_token_logprobs"]
            if [int(p[1]) for p in pairs] != list(ids):
                raise ServerError(f"request {meta.get('id')}: output_token_logprobs do not match output_ids; "
                                  "the server must return logprobs for every generated token (return_logprob).")
            completions.append(ids)
            logprobs.append([float(p[0]) for p in pairs])
            finish.append(K.FINISH_REASONS[meta["finish_reason"]["type"]])
            versions.append(_version(meta.get("weight_version")))
        n = len(items)
        prompt_ids, prompt_mask = K.padded(prompts, self.pad_id, "left")
        completion_ids, completion_mask = K.padded(completions, self.pad_id, "right")
        return TensorDict({
            K.PROMPT_IDS: prompt_ids,
            K.PROMPT_MASK: prompt_mask,
            K.COMPLETION_IDS: completion_ids,
            K.COMPLETION_MASK: completion_mask,
            K.ENGINE_LOGPROBS: K.pad_sequences(logprobs, 0.0, "right", dtype=torch.float32),
            K.FINISH_REASON: torch.tensor(finish, dtype=torch.long),
            K.WEIGHT_VERSION: torch.tensor(versions, dtype=torch.long),
        }, batch_size=[n])


def _version(value) -> int:
    """SGLang reports weight_version as a string; ours are integers."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
