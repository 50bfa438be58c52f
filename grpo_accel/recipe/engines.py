"""The rollout engine a config names and the weight sender that keeps it current: the embedded engine, SGLang
servers (distributed, disk or tensor pushes) or vLLM servers (pushes from disk)."""
from __future__ import annotations

import copy
import logging
from pathlib import Path

from grpo_accel.config.checks import ConfigError
from grpo_accel.config.schema import GRPOConfig
from grpo_accel.recipe.wiring import SGLANG_NAMES, VLLM_NAMES, by_name

log = logging.getLogger(__name__)


def build_engine_and_sender(cfg: GRPOConfig, model, tokenizer, accelerator):
    """The rollout engine and the weight-sync sender that keeps it current."""
    if cfg.rollout.backend == "sglang":
        return _sglang_engine_and_sender(cfg, model, tokenizer, accelerator)
    if cfg.rollout.backend == "vllm":
        return _vllm_engine_and_sender(cfg, model, tokenizer, accelerator)
    from grpo_accel.distributed import gathered_parameters, zero3_partitioned
    from grpo_accel.embedded.engine import EmbeddedEngine
    from grpo_accel.embedded.sender import EmbeddedWeightSync

    r = cfg.rollout
    # Async collection generates while the policy is updated, so the engine needs its own copy of the weights (not
    # of ZeRO-3 shards: the trainer refuses an embedded engine beside ZeRO-3 in async mode, saying why).
    copies = cfg.trainer.async_collection and not zero3_partitioned()
    engine_model = copy.deepcopy(model) if copies else model
    engine = EmbeddedEngine(engine_model, tokenizer, worker=r.embedded_worker, **by_name(EmbeddedEngine, r),
                            gather=(lambda: gathered_parameters(model.parameters())) if r.zero3_gather_full else None)
    return engine, EmbeddedWeightSync(engine, source=model)


def _sglang_engine_and_sender(cfg: GRPOConfig, model, tokenizer, accelerator):
    import torch

    from grpo_accel.batch import stop_token_ids
    from grpo_accel.sglang.engine import SGLangEngine

    r, w = cfg.rollout, cfg.weight_sync
    engine = SGLangEngine(tokenizer=tokenizer, retries=r.request_retries, **by_name(SGLangEngine, r, w),
                          stop_token_ids=stop_token_ids(tokenizer, model.generation_config), names=SGLANG_NAMES)
    _started(cfg, accelerator, engine, "--enable-memory-saver", [i.url for i in engine.servers if not i.memory_saver])
    if w.method == "distributed":
        from grpo_accel.sglang.from_distributed import DistributedWeightSender as Sender
    elif w.method == "disk":
        from grpo_accel.sglang.from_disk import DiskWeightSender as Sender
    else:
        from grpo_accel.sglang.from_tensor import TensorWeightSender as Sender
    settings = by_name(Sender, w, skip=("dtype",))  # bucket_mb, timeout_s, pause_mode, ...; dtype converted below
    if w.method == "disk":
        settings["path"] = w.disk_path or Path(cfg.output_dir) / "weights"
    sender = Sender(accelerator, model, r.urls, api_key=r.api_key, dtype=getattr(torch, w.dtype), names=SGLANG_NAMES,
                    memory_record=Path(cfg.output_dir) / "sglang_memory.json" if r.colocate else None, **settings)
    return engine, sender


def _vllm_engine_and_sender(cfg: GRPOConfig, model, tokenizer, accelerator):
    import torch

    from grpo_accel.batch import stop_token_ids
    from grpo_accel.vllm.engine import VLLMEngine
    from grpo_accel.vllm.servers import VLLMDiskSender

    r, w = cfg.rollout, cfg.weight_sync
    if w.method != "disk":
        raise ConfigError(f"weight_sync.method={w.method}: vLLM servers take weights from disk here (vLLM's NCCL "
                          "weight transfer is not driven yet); set weight_sync.method=disk (the servers must read "
                          "weight_sync.disk_path, default output_dir/weights).")
    engine = VLLMEngine(tokenizer=tokenizer, retries=r.request_retries, **by_name(VLLMEngine, r),
                        stop_token_ids=stop_token_ids(tokenizer, model.generation_config), names=VLLM_NAMES)
    _started(cfg, accelerator, engine, "--enable-sleep-mode", [i.url for i in engine.servers if not i.sleep_mode])
    sender = VLLMDiskSender(accelerator, model, r.urls, w.disk_path or Path(cfg.output_dir) / "weights",
                            api_key=r.api_key, dtype=getattr(torch, w.dtype), names=VLLM_NAMES,
                            **by_name(VLLMDiskSender, w, skip=("dtype",)))
    return engine, sender


def _started(cfg: GRPOConfig, accelerator, engine, flag: str, without_flag: list[str]) -> None:
    """The servers said once; colocated ones must be able to free their memory (``flag``)."""
    if accelerator.is_main_process:
        log.info(engine.description)
    if cfg.rollout.colocate and without_flag:
        raise ConfigError(f"rollout.colocate=true: {', '.join(without_flag)} runs without {flag}, so it cannot free "
                          "its GPU memory for training; start it with that flag, or set rollout.colocate=false.")
