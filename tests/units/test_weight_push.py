"""The weight push belongs to no engine (House 5): weight_sync.push.WeightPusher drives any engine's servers and
transport in one order, pushes everything again after a failure and checks the servers after each push. Here the
engine is a few lines of this test (no server): what an engine must provide is the two small objects."""
import pytest
import torch

from grpo_accel.weight_sync.push import EngineServers, Transport, WeightPusher, WeightSyncError


class Servers(EngineServers):
    def __init__(self, calls: list, wrong_after: int | None = None) -> None:
        self.calls, self.wrong_after = calls, wrong_after

    def before_update(self):
        self.calls.append("take back memory")

    def after_update(self):
        self.calls.append("generate again")

    def recover(self):
        self.calls.append("servers recover")

    def needs_probe(self, first_weight):
        self.calls.append("asked how to check")
        return True

    def compare(self, version, expected, probe, trainer_logprobs, dtype):
        self.calls.append(("compare", version, len(expected), len(probe), tuple(trainer_logprobs.shape)))
        if self.wrong_after is not None and version > self.wrong_after:
            raise WeightSyncError(f"server holds version {self.wrong_after}")


class Wire(Transport):
    def __init__(self, calls: list, failures: int = 0) -> None:
        self.calls, self.failures, self.held = calls, failures, {}

    def open(self):
        self.calls.append("open")

    def send(self, index, bucket, tensors, version, last):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the link dropped")
        self.held.update(zip(bucket.names, [t.clone() for t in tensors]))
        self.calls.append(("send", index, last))

    def finish(self, version):
        self.calls.append(("finish", version))

    def recover(self):
        self.calls.append("transport recover")


def test_one_push_in_order_retried_whole_after_a_failure_and_checked(accelerator, tiny_model):
    calls = []
    wire = Wire(calls, failures=1)
    pusher = WeightPusher(accelerator, tiny_model, Servers(calls), wire, bucket_mb=0.02, dtype=torch.float32,
                          max_attempts=2, verify_tensors=2)
    pusher.push(3)
    buckets = len(pusher.gather.buckets)
    assert buckets > 2, "several buckets, so that the order shows"
    failed = ["take back memory", "open", "transport recover", "servers recover"]  # the first bucket failed
    sent = [("send", i, i == buckets - 1) for i in range(buckets)]
    assert calls == [*failed, "take back memory", "open", *sent, ("finish", 3), "generate again",
                     "asked how to check", ("compare", 3, 2, 32, (31,))]
    assert pusher.pushed == 3 and pusher.stats()["weight_sync_s"] > 0
    state = dict(tiny_model.named_parameters())
    assert wire.held and all(torch.equal(t, state[name].detach()) for name, t in wire.held.items())


def test_servers_that_do_not_hold_the_push_end_in_one_error_after_every_attempt(accelerator, tiny_model):
    calls = []
    pusher = WeightPusher(accelerator, tiny_model, Servers(calls, wrong_after=0), Wire(calls), bucket_mb=1,
                          dtype=torch.float32, max_attempts=2, verify_tensors=1)
    with pytest.raises(WeightSyncError, match=r"after 2 attempts: server holds version 0; the engines hold unknown"):
        pusher.push(1)
    assert [c for c in calls if c[0] == "compare"] == [("compare", 1, 1, 32, (31,))] * 2 and pusher.pushed == 0
    assert calls.count("asked how to check") == 1, "asked once"


def test_a_push_that_failed_on_another_rank_says_so(accelerator, tiny_model, monkeypatch):
    """Issue 74 item 8: under ZeRO-3 the rank whose own part went well ended with "... after 2 attempts: None"."""
    calls = []
    pusher = WeightPusher(accelerator, tiny_model, Servers(calls), Wire(calls), bucket_mb=1, dtype=torch.float32,
                          max_attempts=2, verify_tensors=1)
    monkeypatch.setattr(pusher, "_all_agree", lambda ok: False)  # what any_process answers when another rank failed
    with pytest.raises(WeightSyncError, match=r"after 2 attempts: it failed on another rank, whose line says why; "):
        pusher.push(1)
