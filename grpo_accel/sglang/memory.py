"""What colocated servers (``--enable-memory-saver``) have released of their GPU memory, kept where a restarted
trainer finds it.

No SGLang route tells which memory tags a server has released (0.5.9 and 0.5.23 keep ``offload_tags`` inside the
scheduler), and both wrong guesses kill the server: resuming a tag it holds raises ``KeyError`` in its scheduler
(``offload_tags.remove``), and loading weights into released memory writes to freed GPU memory. So the sender
records each server's released tags in a small JSON file beside the run's checkpoints, written *before* each
release or resume it sends (the state after the call): a trainer killed while a call is under way leaves the
record right, since the server completes a call it has received. Each entry names the server's start (0.5.23's
``startup_time``, else its ``random_seed``, drawn at each start unless given), so that a server restarted since,
which holds all its memory again, is not resumed. A trainer started on the same run folder reads the record back.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
from pathlib import Path

from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.sglang import api

logger = logging.getLogger(__name__)


class ServerMemory:
    """The memory tags each server has released, and the calls that change them.

    Args:
        clients: one admin client per server (release and resume take the admin key).
        servers: what each server reported at ``/server_info`` (its ``instance``).
        record: the JSON file kept for a restarted trainer; None keeps the state in this process only.
    """

    def __init__(self, clients: list[HTTPClient], servers: list[api.ServerInfo], record: Path | None) -> None:
        self.clients, self.record = clients, None if record is None else Path(record)
        self.instances = {c.url: info.instance for c, info in zip(clients, servers)}
        self.released: dict[str, set[str]] = {c.url: set() for c in clients}
        self.known: set[str] = set()  # servers the record names: what they hold is known, not assumed
        self._lock = threading.Lock()  # the servers' calls run at once, each writing its record
        self._read()

    def _read(self) -> None:
        if self.record is None or not self.record.exists():
            return
        try:
            entries = json.loads(self.record.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("%s cannot be read (%s): every server is taken to hold all its memory", self.record, exc)
            return
        for url, instance in self.instances.items():
            entry = entries.get(url) or {}
            if entry:
                self.known.add(url)
            tags = set(entry.get("released") or ())
            if not tags:
                continue
            if entry.get("instance") == instance:
                self.released[url] = tags
                logger.info("%s has %s released (by the trainer before this one, %s)", url, sorted(tags), self.record)
            else:
                logger.warning("%s was restarted since %s recorded %s released: it holds all its memory", url,
                               self.record, sorted(tags))

    def holds_all(self, url: str) -> bool:
        return not self.released[url]

    def release(self, tags: tuple[str, ...]) -> None:
        """Every server frees ``tags`` (those it still holds)."""
        self._each(lambda url: [t for t in tags if t not in self.released[url]], api.release_memory_occupation,
                   lambda url, wanted: self.released[url] | set(wanted))

    def resume(self, tags: tuple[str, ...]) -> None:
        """Every server takes back what it released of ``tags`` (resuming a tag it holds would kill it)."""
        self._each(lambda url: [t for t in api.MEMORY_TAGS if t in tags and t in self.released[url]],
                   api.resume_memory_occupation, lambda url, wanted: self.released[url] - set(wanted))

    def _each(self, wanted_of, request, after) -> None:
        """Per server with something to do: record the state after the call, then make it (all servers at once).
        A server that answers with an error did not make the change: its record goes back (one that does not
        answer at all may have made it, and keeps the new record)."""
        calls = [(client, wanted_of(client.url)) for client in self.clients]
        calls = [(client, wanted) for client, wanted in calls if wanted]
        if not calls:  # every push asks; only colocated servers have anything released
            return
        before = {client.url: set(self.released[client.url]) for client, _ in calls}
        for client, wanted in calls:
            self._write(client.url, after(client.url, wanted))

        def call(client: HTTPClient, wanted: list[str]) -> None:
            try:
                client.post(*request(wanted))
            except ServerError as exc:
                if exc.status is not None:
                    self._write(client.url, before[client.url])
                raise

        with concurrent.futures.ThreadPoolExecutor(max(1, len(calls))) as pool:
            for future in [pool.submit(call, client, wanted) for client, wanted in calls]:
                future.result()

    def _write(self, url: str, tags: set[str]) -> None:
        with self._lock:
            self.released[url] = tags
            if self.record is None:
                return
            entries = {u: {"instance": self.instances[u], "released": sorted(t)} for u, t in self.released.items()}
            self.record.parent.mkdir(parents=True, exist_ok=True)
            part = self.record.with_name(self.record.name + ".part")
            part.write_text(json.dumps(entries, indent=1))
            os.replace(part, self.record)  # atomic: a kill leaves the old record or the new one
