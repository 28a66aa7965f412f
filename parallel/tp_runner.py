"""Rank 0's side of tensor parallelism: the model the `ModelRunner` drives.

The runner packs a step as it always does and calls the model; this wrapper first sends the
packed inputs to the other ranks (`StepChannel`), then runs rank 0's shard, whose all-reduces the
other ranks join. `compute_logits` likewise sends the hidden rows, and the LM head's gather brings
every rank's vocabulary slice back here, where sampling happens. The runner itself is unchanged.

Any failure inside a command leaves the ranks out of step (some wait in a collective that will
never come), so the first one marks the group failed for good: later calls raise
`RankFailedError` at once, and the engine, which polls `failure`, turns unhealthy. While the
engine idles, a heartbeat (NOOP) keeps the waiting ranks' timeout for dead peers only.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import structlog
import torch

from cadenza.parallel.errors import RankFailedError
from cadenza.parallel.groups import ParallelContext
from cadenza.parallel.step_codec import Command, StepChannel

log = structlog.get_logger(__name__)


class TensorParallelModel:
    """Wraps rank 0's shard; every call is one command to the group, under one lock."""

    def __init__(self, model: torch.nn.Module, ctx: ParallelContext, heartbeat_seconds: float) -> None:
        self.model = model
        self.ctx = ctx
        self.channel = StepChannel(ctx)
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._last_command = time.monotonic()
        self._stopped = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, args=(heartbeat_seconds,), name="cadenza-tp-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def __getattr__(self, name: str):
        # Everything else (cfg, kernels, compute_dtype, ...) is the shard's.
        return getattr(self.__dict__["model"], name)

    @contextmanager
    def _command(self, what: str) -> Iterator[None]:
        with self._lock:
            if self.failure is not None:
                raise RankFailedError(f"the tensor-parallel group has failed: {self.failure}")
            if self._stopped.is_set():
                raise RankFailedError("the tensor-parallel group has been stopped")
            try:
                yield
            except Exception as exc:
                self.failure = f"{what} failed on the tensor-parallel group: {exc!r}"
                log.error("Tensor-parallel group failed", during=what, error=repr(exc))
                raise RankFailedError(self.failure) from exc
            finally:
                self._last_command = time.monotonic()

    def __call__(self, input_ids, positions, kv_caches, meta, backend) -> torch.Tensor:
        with self._command("a step"):
            self.channel.send_step(input_ids, positions, meta)
            return self.model(input_ids, positions, kv_caches, meta, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._command("the logits gather"):
            self.channel.send_logits(hidden)
            return self.model.compute_logits(hidden)

    def _beat(self, interval: float) -> None:
        while not self._stopped.wait(interval):
            if time.monotonic() - self._last_command < interval or not self._lock.acquire(blocking=False):
                continue  # a step went by recently, or one is running: no heartbeat needed
            try:
                if self.failure is None:
                    self.channel.send(Command.NOOP)
                    self._last_command = time.monotonic()
            except Exception as exc:
                self.failure = f"a tensor-parallel rank stopped answering: {exc!r}"
                log.error("Tensor-parallel heartbeat failed", error=repr(exc))
            finally:
                self._lock.release()

    def stop(self, timeout: float = 5.0) -> None:
        """Tell the other ranks to leave their loop (unless the group has failed); stop the heartbeat."""
        self._stopped.set()
        if not self._lock.acquire(timeout=timeout):
            return  # a step is stuck in a collective: the ranks end by their own timeout
        try:
            if self.failure is None:
                self.channel.send(Command.STOP)
        except Exception as exc:
            log.warning("Could not send STOP to the tensor-parallel ranks", error=repr(exc))
        finally:
            self._lock.release()
