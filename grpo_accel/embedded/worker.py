"""A decode worker: the embedded engine's decode loop in a process of its own, on weights in shared memory.

With asynchronous collection, generation and training run at the same time. In one process they share the
interpreter lock, and at small sizes (where each tensor operation costs more Python than arithmetic) they then
take turns instead of overlapping. A worker process decodes on another core while the trainer optimises.

The engine's model is handed to the worker once, at start: torch's multiprocessing moves its parameters and
buffers into shared memory, so the worker reads the very tensors that the weight-sync sender updates in place
(under the engine's lock, which the engine holds for the whole of a remote decode). Each request carries the
prompts, sampling keys and settings; the answer carries tokens and logprobs as arrays.
"""
from __future__ import annotations

import traceback

import torch
from torch import Tensor, nn

from grpo_accel.embedded.decode import Decoder, DecodeSettings


class DecodeWorker:
    """Runs a :class:`~grpo_accel.embedded.decode.Decoder` of ``model`` in a spawned process; called like one.

    Args:
        model: a module whose parameters stay in place (an engine's own copy, updated with ``copy_``).
        compiled: the worker's decoder compiles the forward (see :class:`~grpo_accel.embedded.decode.Decoder`).
        threads: torch threads in the worker.
    """

    def __init__(self, model: nn.Module, compiled: bool = False, threads: int = 1) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.model = model
        self.process = context.Process(target=_serve, args=(model, compiled, child, threads), name="grpo-decode-worker",
                                       daemon=True)
        self.process.start()
        child.close()

    def __call__(self, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int, keys: Tensor | None,
                 settings: DecodeSettings, **continuation: Tensor) -> tuple[Tensor, Tensor]:
        """As :meth:`Decoder.__call__ <grpo_accel.embedded.decode.Decoder.__call__>`, in the worker (CPU tensors)."""
        unshared = [name for name, p in self.model.named_parameters() if not p.is_shared()]
        if unshared:  # a parameter was replaced, not updated in place: the worker would sample from old weights
            raise RuntimeError(f"decode worker: parameters {unshared[:3]} are no longer in shared memory (replaced "
                               "rather than updated in place); the worker cannot see them. Update the engine's "
                               "weights with copy_ (EmbeddedWeightSync does).")
        request = (prompt_ids.numpy(), prompt_mask.numpy(), group_size, None if keys is None else keys.numpy(), settings,
                   {name: t.numpy() for name, t in continuation.items()})
        try:
            self._conn.send(request)
            status, *answer = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
            self.process.join(timeout=5)
            raise RuntimeError(f"decode worker (pid {self.process.pid}) exited with code {self.process.exitcode}; "
                               "see its error above (out of memory kills it without one).") from exc
        if status == "error":
            raise RuntimeError(f"decode worker failed:\n{answer[0]}")
        tokens, logprobs = answer
        return torch.from_numpy(tokens), torch.from_numpy(logprobs)

    def close(self) -> None:
        """Stop the worker (it also stops with this process: it is a daemon)."""
        if self.process.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.terminate()
        self._conn.close()


def _serve(model: nn.Module, compiled: bool, conn, threads: int) -> None:
    torch.set_num_threads(threads)
    model.eval()
    decoder = Decoder(model, compiled)
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the trainer went away
            return
        if request is None:
            return
        ids, mask, group_size, keys, settings, more = request
        try:
            tokens, logprobs = decoder(torch.from_numpy(ids), torch.from_numpy(mask), group_size,
                                       None if keys is None else torch.from_numpy(keys), settings,
                                       **{name: torch.from_numpy(a) for name, a in more.items()})
            conn.send(("ok", tokens.numpy(), logprobs.numpy()))
        except Exception:  # handed to the trainer, which raises it
            conn.send(("error", traceback.format_exc()))
