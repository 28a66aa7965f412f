"""The actor base: a bounded, typed inbox, a named lifecycle, and supervision of each message.

An actor's state goes `created -> starting -> ready -> draining -> stopped` (or `failed`). It handles
one message at a time. If handling a message raises, `on_error` decides what that costs (usually
failing the requests the message concerned) and the actor carries on; if `on_error` itself raises,
the actor is `failed` and the engine reports itself unhealthy.
"""

from __future__ import annotations

from typing import ClassVar, Generic, TypeVar

import anyio
import structlog
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

M = TypeVar("M")

log = structlog.get_logger(__name__)


def channel(message_type: type[M] | object, capacity: int) -> tuple[MemoryObjectSendStream[M], MemoryObjectReceiveStream[M]]:
    """A typed, bounded channel; `message_type` documents what flows through it."""
    if capacity <= 0:
        raise ValueError("channels are bounded: capacity must be positive")
    return anyio.create_memory_object_stream[M](capacity)  # type: ignore[index]


class Actor(Generic[M]):
    name: ClassVar[str] = "actor"

    def __init__(self, inbox: MemoryObjectReceiveStream[M]) -> None:
        self.inbox = inbox
        self.state = "created"
        self.error: BaseException | None = None
        self.log = log.bind(actor=self.name)

    async def run(self, *, task_status: TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        self.state = "starting"
        await self.on_start()
        self.state = "ready"
        task_status.started()
        try:
            async with self.inbox:
                async for message in self.inbox:
                    try:
                        await self.handle(message)
                    except Exception as exc:  # supervision: one bad message must not stop the actor
                        self.log.error("Message failed", message=type(message).__name__, error=repr(exc))
                        await self.on_error(message, exc)
            self.state = "draining"
            await self.on_stop()
            self.state = "stopped"
        except anyio.get_cancelled_exc_class():
            self.state = "stopped"
            raise
        except Exception as exc:
            self.state, self.error = "failed", exc
            self.log.error("Actor failed", error=repr(exc))
            raise

    async def on_start(self) -> None:
        """Runs before the actor reports ready."""

    async def on_stop(self) -> None:
        """Runs after the inbox closed and drained."""

    async def handle(self, message: M) -> None:
        raise NotImplementedError

    async def on_error(self, message: M, exc: Exception) -> None:
        """Contain a failed message. The default re-raises: the actor fails."""
        raise exc
