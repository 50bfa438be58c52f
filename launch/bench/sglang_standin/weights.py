"""The stand-in's weight updates (launch/bench/sglang_standin): the weight-update group SGLang's own code joins, the
tensor-parallel ranks as processes, the session guards, distributed and disk loads, memory release and resume,
``/get_weights_by_name``; re-implemented from the SGLang source each part cites, or run from it."""
from __future__ import annotations

import hashlib
import multiprocessing
import os
from pathlib import Path

import torch
import torch.distributed as dist

from sglang_standin.source import SGLangSource
from sglang_standin.scheduler import HTTPError, die

PARTIAL = "The full weights of the ModelRunner are partially updated. Please discard the whole weights."


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def receive_weights(source: SGLangSource, group, names, dtypes, shapes, load_format) -> list[tuple[str, torch.Tensor]]:
    """As ``receive_weights_from_distributed`` / ``_receive_bucketed_weights_from_distributed`` do."""
    if load_format == "flattened_bucket":
        cls = source.FlattenedTensorBucket
        if hasattr(cls, "empty"):  # 0.5.23
            bucket = cls.empty(names, dtypes, shapes, "cpu")
        else:  # 0.5.9: the bucket is built from empty named tensors
            bucket = cls(named_tensors=[(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(names, dtypes, shapes)])
        dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
        return bucket.reconstruct_tensors()
    weights, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes):
        weight = torch.empty(shape, dtype=getattr(torch, dtype))
        handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
        weights.append((name, weight))
    for handle in handles:
        handle.wait()
    return weights


def tp_rank_main(conn, version: str, tp_rank: int) -> None:
    """Tensor-parallel rank ``tp_rank`` of a ``--tp-size`` > 1 server, a process of its own: it joins every
    weight-update group as ``rank_offset + tp_rank`` and receives every broadcast, as SGLang's other TP workers do
    (each receives the full tensors and loads its shard); it keeps a digest of what it received."""
    server = os.getppid()
    torch.set_num_threads(1)
    source = SGLangSource(version)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # its own TP group stand-in
    groups, received = {}, {}
    while True:
        if not conn.poll(0.5):
            if os.getppid() != server:  # the server is gone (killed): so is this rank
                return
            continue
        op, a = conn.recv()
        try:
            result = None
            if op == "init":
                groups[a["group_name"]] = source.init_custom_process_group(
                    backend=a["backend"], init_method=f"tcp://{a['master_address']}:{a['master_port']}",
                    world_size=a["world_size"], rank=a["rank_offset"] + tp_rank, group_name=a["group_name"])
            elif op == "receive":
                tensors = receive_weights(source, groups[a["group_name"]], a["names"], a["dtypes"], a["shapes"],
                                          a["load_format"])
                received.update({name: digest(t) for name, t in tensors})
            elif op == "destroy":
                dist.destroy_process_group(groups.pop(a["group_name"]))
            elif op == "reset":
                for group in groups.values():
                    dist.destroy_process_group(group)
                groups, received = {}, {}
            elif op == "digests":
                result = received
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 (reported to the server, which answers as SGLang would)
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class TPRank:
    """The server's handle on one ``tp_rank_main`` process."""

    def __init__(self, version: str, tp_rank: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=tp_rank_main, args=(child, version, tp_rank), daemon=True)
        self.proc.start()

    def send(self, op: str, args: dict | None = None) -> None:
        self.conn.send((op, args or {}))

    def reply(self):
        status, result = self.conn.recv()
        if status != "ok":
            raise RuntimeError(result)
        return result

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join()


class WeightUpdates:
    """The weight side of the stand-in's ``Server`` (SGLang's weight updater and its session manager)."""

    def guard(self, method: str) -> dict | None:
        """The session guard of ``method`` (0.5.21+), as ``SchedulerWeightUpdaterManager`` applies it."""
        guard = self.source.session_guards.get(method)
        if guard is None:
            return None
        if (guard.refuse_when == "closed") != self.session_open:
            return {"success": False, "message": guard.message}
        return None

    def check_dp(self) -> None:
        """The assertion of the distributed-update methods (0.5.9 tokenizer_communicator_mixin.py; 0.5.23 asserts
        one replica, which --enable-dp-attention keeps): an AssertionError, HTTP 500 as FastAPI answers it."""
        if self.args.dp_size > 1 and not self.args.enable_dp_attention:
            raise HTTPError(500, {"error": {"message": "dp_size must be 1 or dp attention must be enabled for "
                                                       "update weights from distributed"}})

    def init_group(self, req) -> dict:
        name = req.group_name
        if name in self.groups:  # torch refuses a second group of that name inside init_custom_process_group
            return {"success": False, "message": f"Failed to initialize custom process group: The specified group "
                                                 f"name {name} has already been created."}
        fields = {k: getattr(req, k) for k in ("master_address", "master_port", "rank_offset", "world_size",
                                               "group_name", "backend")}
        for rank in self.tp_ranks:  # the other TP workers join at the same time (rank_offset + tp_rank)
            rank.send("init", fields)
        try:
            self.groups[name] = self.source.init_custom_process_group(
                backend=req.backend, init_method=f"tcp://{req.master_address}:{req.master_port}",
                world_size=req.world_size, rank=req.rank_offset + 0, group_name=name)
            for rank in self.tp_ranks:
                rank.reply()
        except Exception as exc:  # noqa: BLE001 (SGLang reports any failure this way)
            return {"success": False, "message": f"Failed to initialize custom process group: {exc}."}
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, req) -> dict:
        if req.group_name not in self.groups:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        dist.destroy_process_group(self.groups.pop(req.group_name))
        for rank in self.tp_ranks:
            rank.send("destroy", {"group_name": req.group_name})
            rank.reply()
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def session(self, begin: bool) -> dict:
        refusal = self.guard("begin_weight_update" if begin else "end_weight_update")
        if refusal is not None:
            return refusal
        self.session_open = begin
        return {"success": True, "message": "Success"}

    def update_distributed(self, req, how: str | None) -> dict:
        refusal = self.guard("update_weights_from_distributed")
        if how == "refuse":
            refusal = {"success": False, "message": self.source.session_guards.get("update_weights_from_distributed",
                                                                                   _NO_SESSION).message}
        if refusal is not None:
            return refusal  # nothing was received: the trainer's broadcast has no partner
        group = self.groups.get(req.group_name)
        if group is None:
            return {"success": False, "message": f"Failed to receive weights: Group {req.group_name} not in "
                                                 f"{list(self.groups)}. Please call `init_weights_update_group` first."}
        with self._writer():
            fields = {"group_name": req.group_name, "names": req.names, "dtypes": req.dtypes, "shapes": req.shapes,
                      "load_format": req.load_format}
            for rank in self.tp_ranks:
                rank.send("receive", fields)
            tensors = receive_weights(self.source, group, req.names, req.dtypes, req.shapes, req.load_format)
            for rank in self.tp_ranks:
                rank.reply()
            if how == "success_false":
                return {"success": False, "message": f"Failed to update parameter online: injected. {PARTIAL}"}
            if how == "ignore":  # a broken server: claims the update, keeps its weights
                if req.weight_version is not None:
                    with self.lock:
                        self.record_weight_version(str(req.weight_version))
                return {"success": True, "message": "Succeeded to update parameter online."}
            return self._load(dict(tensors), req.flush_cache, req.weight_version, how)

    def update_disk(self, req, how: str | None) -> dict:
        from safetensors.torch import load_file

        files = sorted(Path(req.model_path).glob("*.safetensors"))
        if not files:
            return {"success": False, "message": f"Failed to get weights iterator: no safetensors in {req.model_path}.",
                    "num_paused_requests": 0}
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        with self._writer():
            return {**self._load(state, req.flush_cache, req.weight_version, how),
                    "num_paused_requests": 0}

    def memory(self, release: bool, tags: list[str] | None) -> None:
        """``release_memory_occupation`` / ``resume_memory_occupation`` (0.5.9
        srt/managers/scheduler_update_weights_mixin.py, 0.5.23 scheduler_components/weight_updater.py): no tags
        means all; no-ops without --enable-memory-saver. Where SGLang's scheduler raises or touches freed memory,
        the server dies: a release while requests run (its assertion; 0.5.23 counts the waiting queue unless paused),
        a release of what is already released (weights: ``_export_static_state`` reads the freed weights; the other
        tags are held to the same rule), a resume of a tag not released (``offload_tags.remove``). Resumed weights
        hold garbage, unless --enable-weights-cpu-backup kept a copy at their release."""
        if not self.args.enable_memory_saver:
            return
        tags = set(tags or ["kv_cache", "weights", "cuda_graph"])  # GPU_MEMORY_ALL_TYPES, srt/constants.py
        with self.between_steps(), self.lock:
            self.weight_epoch += "weights" in tags
            if release:
                if not self.idle():
                    die(f"AssertionError: {self.source.release_idle_message}")
                if tags & self.released:
                    die(f"release_memory_occupation of {sorted(tags & self.released)}, already released")
                self.released |= tags
                if "weights" in tags:
                    if self.args.enable_weights_cpu_backup:
                        self.backup = [{n: p.detach().clone() for n, p in r.model.named_parameters()}
                                       for r in self.dp_ranks]
                    self._fill(lambda p: torch.full_like(p, float("nan")))  # freed: nothing may read it
                return
            missing = sorted(tags - self.released)
            if missing:
                die(f"KeyError: {missing[0]!r} (resume_memory_occupation of a tag that is not released)")
            self.released -= tags
            if "weights" in tags:
                if self.backup is not None:
                    for rank, saved in zip(self.dp_ranks, self.backup):
                        with torch.no_grad():
                            for n, p in rank.model.named_parameters():
                                p.copy_(saved[n])
                    self.backup = None
                else:
                    self._fill(lambda p: torch.randn_like(p) * 100)  # whatever the memory held

    def _fill(self, value) -> None:
        with torch.no_grad():
            for rank in self.dp_ranks:
                for p in rank.model.parameters():
                    p.copy_(value(p))

    def _load(self, state: dict, flush_cache: bool, weight_version, how: str | None = None) -> dict:
        """Load ``state`` into every dp rank's model (how="ignore_dp1": dp rank 1 keeps its weights, a broken
        server), between steps; the version change is recorded; the flush fails unless idle."""
        if "weights" in self.released:
            die("loading weights into released memory (illegal memory access)")
        with self.between_steps():
            self.weight_epoch += 1  # a running batch's cache was computed with the weights before
            for index, rank in enumerate(self.dp_ranks):
                params = dict(rank.model.named_parameters())
                for name, t in state.items():
                    if name not in params or tuple(params[name].shape) != tuple(t.shape):
                        return {"success": False, "message": f"Failed to update parameter online: {name} "
                                                             f"{tuple(t.shape)} does not fit the model. {PARTIAL}"}
                    if how == "ignore_dp1" and index == 1:
                        continue
                    with torch.no_grad():
                        params[name].copy_(t.to(params[name].dtype))
            with self.lock:
                self.loads += 1
                if weight_version is not None:
                    self.record_weight_version(str(weight_version))
                idle = self.idle()
        if flush_cache and not idle:
            return {"success": False, "message": "Weights were updated, but the cache was not flushed because "
                                                 "requests are still running or queued."}
        return {"success": True, "message": "Succeeded to update parameter online."}

    def weights_by_name(self, req):
        """``TokenizerManager.get_weights_by_name``: one dp rank's rows, else a list with one entry per dp rank,
        None where the model class lacks the method (the HTTP route answers a lone None with 400)."""
        if "weights" in self.released:
            die("get_weights_by_name read released weights (illegal memory access)")
        supported = self.architecture in self.source.weights_by_name_architectures
        values = []
        for rank in self.dp_ranks:
            params = dict(rank.model.named_parameters())
            found = supported and req.name in params
            values.append(params[req.name].detach().float().tolist()[: req.truncate_size] if found else None)
        if len(values) == 1:
            if values[0] is None:
                raise HTTPError(400, {"error": {"message": "Get parameter by name failed"}})
            return values[0]
        return values

    def _writer(self):
        """An update waits for in-flight requests unless generation is paused (the tokenizer manager's
        ``model_update_lock.writer_lock``)."""
        server = self

        class Writer:
            def __enter__(self):
                with server.lock:
                    while server.generating and not server.is_pause:
                        server.lock.wait()

            def __exit__(self, *exc):
                return False

        return Writer()


_NO_SESSION = type("Guard", (), {"message": "Failed to receive weights: refused"})()
