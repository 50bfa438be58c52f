"""A Hugging Face Hub stand-in on 127.0.0.1 that answers the upload calls of ``huggingface_hub`` (the Hub cannot be
reached from here, and its server is not public): re-implemented from the client's side of each call in
huggingface_hub (the installed release):

* ``POST /api/repos/create`` (``hf_api.HfApi.create_repo``): ``{"name", "organization", "visibility"}`` -> 200
  ``{"url"}`` under the token's user when no organization is given; 409 with the same ``url`` when the repository
  exists (the client's ``exist_ok`` reads it).
* ``POST /api/models/{repo}/preupload/{revision}`` (``_commit_api._fetch_upload_modes``): ``{"files": [{"path",
  "size", "sample"}]}`` -> ``{"files": [{"path", "uploadMode", "shouldIgnore", "oid"}]}``; files under 10 MB are
  "regular" (their content goes in the commit, base64), larger ones "lfs", as the Hub answers.
* ``POST /{repo}.git/info/lfs/objects/batch`` (``lfs.post_lfs_batch_info``): ``{"operation": "upload", "objects":
  [{"oid", "size"}], "hash_algo": "sha256"}`` -> ``{"transfer": "basic", "objects": [{"oid", "size", "actions":
  {"upload": {"href"}}}]}``; then ``PUT href`` with the file (``lfs._upload_single_part``), whose sha256 must be
  its oid.
* ``POST /api/models/{repo}/commit/{revision}`` (``_commit_api._prepare_commit_payload`` / ``_send_commit``):
  NDJSON, a ``header`` line then one ``file`` (base64) or ``lfsFile`` (oid) line per file -> ``{"commitUrl",
  "commitOid"}``.

Every call needs ``Authorization: Bearer <token>``; a repository whose name ends in ``-unwritable`` refuses commits
with 403, as the Hub does for a token without write access to it.
"""
from __future__ import annotations

import base64
import hashlib
import json
import tempfile
import threading
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

USER = "trainer-user"
LFS_THRESHOLD = 10 * 1024 * 1024


class HubStandIn:
    """``with HubStandIn(token) as hub: hub.url ...``; ``hub.repos[repo_id]`` holds each repository's private flag,
    its files (path -> bytes; an LFS file: the Path of its stored content) and its commits (messages)."""

    def __init__(self, token: str) -> None:
        self.token, self.repos, self.calls = token, {}, []
        self.store = Path(tempfile.mkdtemp(prefix="hub-standin-"))  # LFS objects by oid
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "HubStandIn":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import shutil

        self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.store, ignore_errors=True)

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                hub.calls.append(("GET", self.path))
                self.answer(404, {"error": "Repository Not Found"})

            def body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    self.rfile.readline()
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_PUT(self):  # an LFS object's content, at the href the batch answer gave
                hub.calls.append(("PUT", self.path))
                oid, data = self.path.rsplit("/", 1)[-1], self.body()
                if hashlib.sha256(data).hexdigest() != oid:
                    return self.answer(400, {"error": "the content's sha256 is not its oid"})
                (hub.store / oid).write_bytes(data)
                self.answer(200, {})

            def do_POST(self):
                body = self.body()
                hub.calls.append(("POST", self.path))
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self.answer(401, {"error": "Invalid credentials in Authorization header"})
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    return self.create(json.loads(body))
                if path.endswith(".git/info/lfs/objects/batch"):
                    objects = json.loads(body)["objects"]
                    return self.answer(200, {"transfer": "basic", "objects": [
                        {"oid": o["oid"], "size": o["size"],
                         "actions": {"upload": {"href": f"{hub.url}/lfs-objects/{o['oid']}"}}} for o in objects]})
                parts = path.removeprefix("/api/models/").split("/")
                repo, action = "/".join(parts[:2]), parts[2] if len(parts) > 2 else ""
                if repo not in hub.repos:
                    return self.answer(404, {"error": "Repository Not Found"})
                if action == "preupload":
                    files = json.loads(body)["files"]
                    return self.answer(200, {"files": [
                        {"path": f["path"], "uploadMode": "lfs" if f["size"] >= LFS_THRESHOLD else "regular",
                         "shouldIgnore": False, "oid": None} for f in files]})
                if action == "commit":
                    return self.commit(repo, body)
                return self.answer(404, {"error": f"no such endpoint: {path}"})

            def create(self, payload: dict) -> None:
                repo = f"{payload.get('organization') or USER}/{payload['name']}"
                if repo in hub.repos:
                    return self.answer(409, {"error": "You already created this model repo",
                                             "url": f"{hub.url}/{repo}"})
                hub.repos[repo] = {"private": payload.get("visibility") == "private", "files": {}, "commits": []}
                self.answer(200, {"url": f"{hub.url}/{repo}"})

            def commit(self, repo: str, body: bytes) -> None:
                if repo.endswith("-unwritable"):
                    return self.answer(403, {"error": f"You don't have the rights to write to {repo}"})
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                header = next(line["value"] for line in lines if line["key"] == "header")
                files = hub.repos[repo]["files"]
                for line in lines:
                    if line["key"] == "file":
                        files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                    elif line["key"] == "lfsFile":
                        stored = hub.store / line["value"]["oid"]
                        if not stored.is_file():
                            return self.answer(422, {"error": f"LFS object {line['value']['oid']} was never uploaded"})
                        files[line["value"]["path"]] = stored
                hub.repos[repo]["commits"].append(header["summary"])
                oid = hashlib.sha1(body).hexdigest()
                self.answer(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid})

        return Handler
