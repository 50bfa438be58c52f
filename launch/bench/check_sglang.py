"""Compare an SGLang server with a finished grpo_accel run: release, weight version, weights and generations.

    python launch/bench/check_sglang.py --url http://127.0.0.1:30000 --run runs/gpu_check/run [--api-key K]

Prints one verdict line per check (PASS, FAIL or SKIP with the numbers behind it) and exits 1 if any check
failed. ``launch/bench/gpu_check.sh`` runs it against a real server; the tests run it against the stand-in.

- release: ``/server_info`` names a release in the supported range;
- weight version: ``/model_info`` reports the version of the run's last push;
- weights: the first rows of a few parameters (``/get_weights_by_name``) equal the run's final weights at the
  sync dtype (SKIP where the served model does not implement it);
- generations: the server's greedy completions of a few prompts, teacher-forced through the run's final
  weights at the sync dtype: the mean gap between the server's and the trainer's logprobs of those tokens, and
  how many of the server's tokens are the trainer's argmax too.
"""
from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch
import yaml

from grpo_accel.http import HTTPClient
from grpo_accel.sglang import api

PROMPTS = ["What is 2+3?", "Name a colour.", "1+2=", "Write one word."]
GAP = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}  # mean |logprob gap| allowed, by sync dtype


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def final_model(run: Path, dtype: torch.dtype):
    """The run's policy after its last step (a LoRA run's merged), as a transformers model at ``dtype``; and its
    tokenizer."""
    from transformers import AutoTokenizer

    from grpo_accel.checkpoint import Checkpoint
    from grpo_accel.lora import merged_model
    from grpo_accel.run.export import load_policy

    last = Checkpoint(run / "checkpoints").complete()[-1]
    model = merged_model(load_policy(last))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return AutoTokenizer.from_pretrained(last / "hf"), model.to(device=device, dtype=dtype).eval()


def check(url: str, run: Path, api_key: str | None, admin_api_key: str | None) -> list[tuple[str, str, str]]:
    config = yaml.safe_load((run / "config.yaml").read_text())
    dtype_name = config["weight_sync"]["dtype"]
    dtype = getattr(torch, dtype_name)
    summary = json.loads((run / "summary.json").read_text())
    reader = HTTPClient(url, api_key, retries=0)
    admin = HTTPClient(url, admin_api_key or api_key, retries=0, key_setting="--admin-api-key")
    verdicts = []

    info = api.read_server_info(reader)
    low, high = api.SUPPORTED
    verdicts.append(("release", "PASS" if low <= info.version <= high else "FAIL",
                     f"SGLang {dotted(info.version)} (supported {dotted(low)} to {dotted(high)}), tp {info.tp_size}, "
                     f"deterministic inference {'on' if info.deterministic else 'off'}"))
    served = str(reader.get("/model_info").get("weight_version"))
    verdicts.append(("weight version", "PASS" if served == str(summary["weight_version"]) else "FAIL",
                     f"server {served}, run {summary['weight_version']}"))

    tokenizer, model = final_model(run, dtype)
    named = list(model.named_parameters())
    checked, mismatched = 0, []
    for name, p in named[:3] + named[-1:]:
        ranks = api.read_weight_rows(admin, info, name, 4)  # one entry per dp rank
        if ranks is None:
            verdicts.append(("weights", "SKIP", f"the served {info.url} model has no /get_weights_by_name"))
            break
        checked += 1
        for rank, rows in enumerate(ranks):
            got, want = torch.tensor(rows), p.detach().float().cpu()
            want = want.reshape(-1)[: got.numel()] if want.dim() < 2 else want[: got.shape[0]]
            if got.shape != want.shape or not torch.equal(got, want.reshape(got.shape)):
                mismatched.append(f"{name} (dp rank {rank})" if info.dp_ranks > 1 else name)
    else:
        verdicts.append(("weights", "FAIL" if mismatched else "PASS",
                         f"{checked} parameters' first rows compared exactly at {dtype_name}"
                         + (f"; differ: {mismatched}" if mismatched else "")))

    gaps, agree, total = [], 0, 0
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        path, body = api.generate([ids], [api.sampling_params(16, 0.0, 1.0, 0, seed=None)], [uuid.uuid4().hex])
        item = reader.post(path, body)[0]
        out = [int(t) for t in item["output_ids"]]
        served_lp = torch.tensor([float(v[0]) for v in item["meta_info"]["output_token_logprobs"]])
        with torch.no_grad():
            full = torch.tensor([ids + out], device=next(model.parameters()).device)
            logits = model(full).logits[0, len(ids) - 1:-1].float()  # [len(out), V]
        trainer_lp = torch.log_softmax(logits, -1).gather(-1, full[0, len(ids):, None])[:, 0].cpu()
        gaps.append((served_lp - trainer_lp).abs().mean())
        agree += int((logits.argmax(-1).cpu() == torch.tensor(out)).sum())
        total += len(out)
    gap = float(torch.stack(gaps).mean())
    verdicts.append(("generations", "PASS" if gap <= GAP[dtype_name] else "FAIL",
                     f"{len(PROMPTS)} greedy completions, {total} tokens: mean logprob gap {gap:.4f} "
                     f"(allowed {GAP[dtype_name]}), trainer argmax agrees on {agree}/{total}"))
    return verdicts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--run", required=True, type=Path, help="the run's output_dir")
    parser.add_argument("--api-key")
    parser.add_argument("--admin-api-key")
    args = parser.parse_args(argv)
    verdicts = check(args.url, args.run, args.api_key, args.admin_api_key)
    for name, verdict, detail in verdicts:
        print(f"{verdict:4}  {name}: {detail}")
    return 1 if any(v == "FAIL" for _, v, _ in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
