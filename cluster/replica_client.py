"""The server's connection to one data-parallel replica (`ReplicaClient`): sends requests, routes
each output frame to its request's stream, and ends every open request with `REPLICA_FAILED` when
the connection drops or the replica reports itself unhealthy. `call` sends one step of a KV
transfer (disaggregation, `kv_transfer.py`) and waits for its answer; a replica that fails fails
those waits too, with `ReplicaFailedError`.
"""

from __future__ import annotations

import anyio
import structlog

from cadenza.cluster.replica_server import error_output
from cadenza.cluster.wire import FrameStream
from cadenza.engine.streams import GenerationOutput
from cadenza.parallel.errors import ReplicaFailedError
from cadenza.parallel.lifecycle import Address, ManagedProcess

log = structlog.get_logger(__name__)

# The error code of a request whose replica died: the same whether it was local or on Ray, and the
# one an engine gives when it fails (HTTP 503).
REPLICA_FAILED = "engine_failed"


class KVStepError(RuntimeError):
    """A replica answered a KV transfer step with an error; the replica itself serves on."""


class ReplicaClient:
    """The server's connection to one replica: sends requests, routes outputs to their streams."""

    def __init__(self, index: int, handle: ManagedProcess, frames: FrameStream) -> None:
        self.index = index
        self.handle = handle
        self.frames = frames
        self.closing = False
        self.recovering = False  # failed, and its handle is bringing it back
        self.unhealthy = False  # failed by its own report: it still runs, and must be restarted
        self.on_metrics = lambda: None
        self.on_failure = lambda client: None
        self.streams: dict[str, anyio.abc.ObjectSendStream[GenerationOutput]] = {}
        self.replies: dict[str, anyio.abc.ObjectSendStream[tuple]] = {}  # a KV step's answer, by request
        self.snapshot: dict[str, float] = {}
        self.failure: str | None = None

    @classmethod
    async def connect(cls, index: int, handle: ManagedProcess, address: Address | None = None) -> "ReplicaClient":
        address = address or handle.address
        return cls(index, handle, FrameStream(await anyio.connect_tcp(address.host, address.port)))

    async def send(self, message: tuple) -> None:
        await self.frames.send(message)

    async def call(self, message: tuple) -> tuple:
        """Send a KV transfer step (`message[1]` is its request id; one at a time per request) and
        return its answer's fields after ("kv", id, kind). `KVStepError` when the replica reports
        the step failed, `ReplicaFailedError` when the replica fails meanwhile."""
        request_id = message[1]
        send, receive = anyio.create_memory_object_stream[tuple](1)
        self.replies[request_id] = send
        try:
            async with receive:
                if self.failure is not None:
                    raise ReplicaFailedError(self.failure)
                try:
                    await self.send(message)
                except Exception as exc:
                    self.fail(f"lost data-parallel replica {self.index}: {exc!r}")
                    raise ReplicaFailedError(self.failure) from exc
                try:
                    reply = await receive.receive()
                except anyio.EndOfStream:
                    raise ReplicaFailedError(self.failure or f"data-parallel replica {self.index} failed") from None
        finally:
            if self.replies.get(request_id) is send:
                del self.replies[request_id]
        if reply[2] == "error":
            raise KVStepError(f"data-parallel replica {self.index}: {message[0]}: {reply[3]}")
        return reply[3:]

    async def read(self) -> None:
        """Deliver outputs until the connection ends; then every open request ends with an error."""
        try:
            while True:
                message = await self.frames.receive()
                match message:
                    case ("out", batch):
                        for request_id, out in batch:
                            stream = self.streams.get(request_id)
                            if stream is None:
                                continue
                            try:
                                stream.send_nowait(out)
                            except anyio.WouldBlock:  # its reader fell too far behind: cut it off
                                self.end(request_id, "slow_reader", "the client is not reading the stream")
                                await self.send(("abort", request_id))
                            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                                self.streams.pop(request_id, None)
                    case ("kv", request_id, *_):
                        waiter = self.replies.pop(request_id, None)
                        if waiter is not None:  # else its caller gave up waiting
                            try:
                                waiter.send_nowait(message)
                            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                                pass
                            waiter.close()
                    case ("metrics", snapshot, healthy):
                        self.snapshot = snapshot
                        self.on_metrics()
                        if not healthy:
                            self.unhealthy = True
                            self.fail(f"data-parallel replica {self.index} is unhealthy")
                    case _:
                        raise ReplicaFailedError(f"unknown message from replica {self.index}: {message!r}")
        except Exception as exc:
            if not self.closing:
                self.fail(f"lost data-parallel replica {self.index}: {exc!r}")

    def fail(self, reason: str) -> None:
        """End every open request with `REPLICA_FAILED`; the first failure tells the engine."""
        first = self.failure is None
        if first:
            self.failure = reason
            log.error("Replica failed", replica=self.index, reason=reason)
        for request_id in list(self.streams):
            self.end(request_id, REPLICA_FAILED, reason)
        for waiter in list(self.replies.values()):
            waiter.close()  # its `call` raises ReplicaFailedError
        self.replies.clear()
        if first:
            self.on_failure(self)

    def end(self, request_id: str, code: str, message: str, finish_reason: str = "error") -> None:
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            last = error_output(request_id, code, message)
            if finish_reason != "error":
                last = GenerationOutput(request_id, "", (), None, finish_reason, 0, 0, 0)
            try:
                stream.send_nowait(last)
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            stream.close()
