"""A loopback stand-in for an SGLang server, written from ../shared/docs/sglang-protocol.md (0.5.9 baseline).

    python tests/sglang_standin.py --port 30000 --model DIR [--api-key KEY] [--tp-size 1] [--startup-delay 0]

It serves a tiny transformers model and is strict where SGLang is: unknown body keys or sampling params
(0.5.23 schema validation), both/neither of text and input_ids, mismatched batch lengths, differing ``n``
-> HTTP 400 ``{"error": {"message": ...}}``; a missing bearer key -> 401; ``/health`` is 503 until started.
It joins the weight-update group as a real torch.distributed (gloo) peer and receives each bucket exactly as
announced (tensors in ``names`` order with the announced dtype/shape, or one uint8 buffer for
``flattened_bucket``); it loads them only after receiving, so a wrong name/shape fails the update with
``success: false`` and "weights may be partially updated" like SGLang. ``flush_cache=true`` fails while
requests run; an update waits for in-flight /generate requests unless generation is paused (writer lock).

Test control, outside the protocol: ``POST /_standin/fail {"path": "/update_weights_from_distributed",
"times": 1, "how": "success_false" | "http_500" | "abort"}`` makes the next calls of ``path`` fail (a distributed update
still receives its tensors first, as a failing SGLang load would);
``GET /_standin/state`` returns the weight version, the number of updates and every parameter as lists.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GENERATE_KEYS = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                 "return_text_in_logprobs", "rid", "stream", "lora_path"}
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
                 "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "sampling_seed"}
UPDATE_KEYS = {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
               "load_format"}


class BadRequest(Exception):
    pass


class Server:
    def __init__(self, model_dir: str, tp_size: int, api_key: str | None, startup_delay: float) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_dir, self.tp_size, self.api_key = model_dir, tp_size, api_key
        self.ready_at = time.monotonic() + startup_delay
        self.weight_version, self.updates = "default", 0
        self.paused, self.running = False, 0
        self.lock = threading.Condition()
        self.groups: dict[str, object] = {}
        self.failures: dict[str, list] = {}

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, body: dict):
        unknown = set(body) - GENERATE_KEYS
        if unknown:
            raise BadRequest(f"unknown fields {sorted(unknown)}")
        if ("text" in body) == ("input_ids" in body):
            raise BadRequest("Either text or input_ids should be provided, not both or neither.")
        if "text" in body:
            texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
            prompts, single = [self.tokenizer(t)["input_ids"] for t in texts], not isinstance(body["text"], list)
        else:
            ids = body["input_ids"]
            single = bool(ids) and isinstance(ids[0], int)
            prompts = [ids] if single else ids
            if not all(isinstance(p, list) and all(isinstance(i, int) for i in p) for p in prompts):
                raise BadRequest("input_ids must be a list of ints or a list of lists of ints")
        if body.get("stream"):
            raise BadRequest("this stand-in does not stream")
        params = body.get("sampling_params", {})
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise BadRequest(f"sampling_params has {len(params)} entries for a batch of {len(prompts)}")
        for p in params:
            if set(p) - SAMPLING_KEYS:
                raise BadRequest(f"unknown sampling params {sorted(set(p) - SAMPLING_KEYS)}")
        if len({p.get("n", 1) for p in params}) > 1:
            raise BadRequest("n must be the same in every sampling_params of a batch")
        with self.lock:
            while self.paused:
                self.lock.wait()
            self.running += 1
        try:
            out = [self._sample(prompt, p, body.get("return_logprob", False))
                   for prompt, p in zip(prompts, params) for _ in range(p.get("n", 1))]
        finally:
            with self.lock:
                self.running -= 1
                self.lock.notify_all()
        return out[0] if single and len(out) == 1 else out

    @torch.no_grad()
    def _sample(self, prompt: list[int], p: dict, return_logprob: bool) -> dict:
        start = time.monotonic()
        temperature, top_k, top_p = p.get("temperature", 1.0), p.get("top_k", -1), p.get("top_p", 1.0)
        max_new = p.get("max_new_tokens", 128)
        stop_ids = set(p.get("stop_token_ids") or []) | ({self.tokenizer.eos_token_id} if not p.get("ignore_eos") else set())
        gen = torch.Generator().manual_seed(p["sampling_seed"]) if p.get("sampling_seed") is not None else None
        ids, out, logprobs, reason = list(prompt), [], [], {"type": "length", "length": max_new}
        for _ in range(max_new):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            if temperature < 1e-6:
                token = int(logits.argmax())
                lp = torch.log_softmax(logits, -1)
            else:
                lp = torch.log_softmax(logits / temperature, -1)  # reported BEFORE top-k / top-p
                z = logits / temperature
                if top_k > 0:
                    z = z.masked_fill(z < z.topk(top_k).values[-1], float("-inf"))
                if top_p < 1.0:
                    sz, order = z.sort(descending=True)
                    probs = sz.softmax(-1)
                    drop = probs.cumsum(-1) - probs > top_p
                    z = z.masked_fill(drop.scatter(0, order, drop), float("-inf"))
                token = int(torch.multinomial(z.softmax(-1), 1, generator=gen))
            ids.append(token)
            out.append(token)
            logprobs.append([float(lp[token]), token, None])
            if token in stop_ids:
                reason = {"type": "stop", "matched": token}
                break
        meta = {"id": uuid.uuid4().hex, "finish_reason": reason, "prompt_tokens": len(prompt),
                "completion_tokens": len(out), "cached_tokens": 0, "weight_version": self.weight_version,
                "e2e_latency": time.monotonic() - start}
        if return_logprob:
            meta["output_token_logprobs"] = logprobs
        text = self.tokenizer.decode([t for t in out if t not in stop_ids], skip_special_tokens=True)
        return {"text": text, "output_ids": out, "meta_info": meta}

    # -- weights ---------------------------------------------------------------------------------------

    def init_group(self, body: dict) -> dict:
        from grpo_accel.weight_sync.group import init_weight_update_group

        for key in ("master_address", "master_port", "rank_offset", "world_size"):
            if key not in body:
                raise BadRequest(f"missing {key}")
        backend = body.get("backend", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            return {"success": False, "message": "Failed to init group: NCCL needs a GPU"}
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            return {"success": False, "message": f"Failed to init group: group {name!r} exists; destroy it first"}
        self.groups[name] = init_weight_update_group(backend, body["master_address"], int(body["master_port"]),
                                                     int(body["rank_offset"]), int(body["world_size"]), name, 60)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_distributed(self, body: dict, fail: bool = False) -> dict:
        from grpo_accel.weight_sync.group import broadcast

        if set(body) - UPDATE_KEYS:
            raise BadRequest(f"unknown fields {sorted(set(body) - UPDATE_KEYS)}")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not (len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("names, dtypes and shapes must have the same length")
        group = self.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            return {"success": False, "message": "weight update group not initialized"}
        tensors = [torch.empty(s, dtype=getattr(torch, d)) for s, d in zip(shapes, dtypes)]
        with self._writer():
            if body.get("load_format") == "flattened_bucket":
                flat = torch.empty(sum(t.numel() * t.element_size() for t in tensors), dtype=torch.uint8)
                broadcast(group, flat)
                offset = 0
                for t in tensors:
                    n = t.numel() * t.element_size()
                    t.view(-1).view(torch.uint8).copy_(flat[offset : offset + n])
                    offset += n
            else:
                for t in tensors:
                    broadcast(group, t)
            if fail:
                return {"success": False, "message": "injected load failure; weights may be partially updated"}
            return self._load(dict(zip(names, tensors)), body)

    def update_disk(self, body: dict) -> dict:
        from safetensors.torch import load_file

        folder = Path(body["model_path"])
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            return {"success": False, "message": f"no safetensors in {folder}", "num_paused_requests": 0}
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        with self._writer():
            return {**self._load(state, body), "num_paused_requests": 0}

    def _load(self, state: dict, body: dict) -> dict:
        params = dict(self.model.named_parameters())
        for name, t in state.items():
            if name not in params or tuple(params[name].shape) != tuple(t.shape):
                return {"success": False, "message": f"Failed to update weights: {name} {tuple(t.shape)} does not fit "
                        "the model. Weights may be partially updated."}
            with torch.no_grad():
                params[name].copy_(t.to(params[name].dtype))
        if body.get("flush_cache", True) and self.running:
            return {"success": False, "message": "flush_cache failed: requests are running"}
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        self.updates += 1
        return {"success": True, "message": "Succeeded to update model weights."}

    def _writer(self):
        server = self

        class Writer:
            def __enter__(self):
                with server.lock:
                    while server.running and not server.paused:  # an update waits for in-flight requests
                        server.lock.wait()

            def __exit__(self, *exc):
                return False

        return Writer()


def make_handler(server: Server):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, payload) -> None:
            data = (json.dumps(payload) if not isinstance(payload, str) else payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method: str) -> None:
            path = self.path.split("?")[0]
            if server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                return self._send(401, {"error": {"message": "Unauthorized"}})
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}") if method == "POST" else {}
            except json.JSONDecodeError as exc:
                return self._send(400, {"error": {"message": f"invalid JSON: {exc}"}})
            failures = server.failures.get(path)
            how = failures.pop(0) if failures else None
            if how == "http_500":
                return self._send(500, {"error": {"message": "injected failure"}})
            if how == "abort" and path == "/generate":  # SGLang aborted the requests (e.g. a pause with mode=abort)
                items = server.generate(body)
                for item in items if isinstance(items, list) else [items]:
                    item["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort before prefill",
                                                          "status_code": 503, "err_type": None}
                return self._send(200, items)
            if how == "success_false" and path != "/update_weights_from_distributed":
                return self._send(200, {"success": False, "message": "injected failure; weights may be partially updated"})
            try:
                if how == "success_false":  # receive the announced tensors first, then fail, as SGLang's load would
                    return self._send(200, server.update_distributed(body, fail=True))
                self._route(method, path, body)
            except BadRequest as exc:
                self._send(400, {"error": {"message": str(exc)}})

        def _route(self, method: str, path: str, body: dict) -> None:
            s = server
            if path in ("/health", "/health_generate"):
                return self._send(200 if time.monotonic() >= s.ready_at else 503, "")
            if time.monotonic() < s.ready_at:
                return self._send(503, {"error": {"message": "starting"}})
            if path in ("/get_model_info", "/model_info"):
                return self._send(200, {"model_path": s.model_dir, "weight_version": s.weight_version,
                                        "is_generation": True})
            if path in ("/get_server_info", "/server_info"):
                return self._send(200, {"tp_size": s.tp_size, "dp_size": 1, "version": "0.5.9-standin"})
            if path == "/_standin/state":
                return self._send(200, {"weight_version": s.weight_version, "updates": s.updates,
                                        "params": {n: p.tolist() for n, p in s.model.named_parameters()}})
            if method != "POST" and path not in ("/flush_cache", "/get_weights_by_name"):
                return self._send(405, {"error": {"message": f"{path} needs POST"}})
            if path == "/generate":
                return self._send(200, s.generate(body))
            if path == "/pause_generation":
                with s.lock:
                    s.paused = True
                return self._send(200, {"message": "Generation paused", "status": "ok"})
            if path == "/continue_generation":
                with s.lock:
                    s.paused = False
                    s.lock.notify_all()
                return self._send(200, {"message": "Generation continued", "status": "ok"})
            if path == "/flush_cache":
                return self._send(400 if s.running else 200, "Cache flushed." if not s.running else "running requests")
            if path == "/init_weights_update_group":
                return self._send(200, s.init_group(body))
            if path == "/update_weights_from_distributed":
                return self._send(200, s.update_distributed(body))
            if path == "/update_weights_from_disk":
                return self._send(200, s.update_disk(body))
            if path == "/destroy_weights_update_group":
                group = s.groups.pop(body.get("group_name", "weight_update_group"), None)
                if group is None:
                    return self._send(200, {"success": False, "message": "no such group"})
                from grpo_accel.weight_sync.group import destroy_weight_update_group

                destroy_weight_update_group(group, body.get("group_name", "weight_update_group"))
                return self._send(200, {"success": True, "message": "destroyed"})
            if path == "/get_weights_by_name":
                p = dict(s.model.named_parameters()).get(body.get("name"))
                if p is None:
                    raise BadRequest(f"no parameter {body.get('name')!r}")
                return self._send(200, p.detach()[: body.get("truncate_size", 100)].tolist())
            if path == "/_standin/fail":
                s.failures.setdefault(body["path"], []).extend([body.get("how", "success_false")] * body.get("times", 1))
                return self._send(200, {"ok": True})
            return self._send(404, {"error": {"message": f"no route {path}"}})

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--api-key")
    parser.add_argument("--startup-delay", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    server = Server(args.model, args.tp_size, args.api_key, args.startup_delay)
    ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(server)).serve_forever()


if __name__ == "__main__":
    main()
