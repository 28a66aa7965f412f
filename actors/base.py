"""The actor base: a bounded, typed inbox, a named lifecycle, and supervision of each message.

An actor's state goes `created -> starting -> ready -> draining -> stopped` (or `failed`). It handles
one message at a time, and calls `after_messages` whenever its inbox has nothing more ready.

Fault isolation, the rule for every actor: an exception while handling a message that concerns
one request (`requests_concerned`) ends that request with a typed error (`fail_requests`) and the
actor carries on with the others. Any other exception (a step-wide message, `after_messages`, or
`fail_requests` itself raising) is not attributable: the actor is `failed` and the engine stops
loudly (health fails, every open request ends with `engine_failed`) rather than limping on with
state it can no longer trust.
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
                    await self._handle_contained(message)
                    # Take everything already queued before `after_messages`, so for example a
                    # burst of arrivals shares one scheduled step.
                    while (queued := self._receive_ready()) is not None:
                        await self._handle_contained(queued)
                    await self.after_messages()
            self.state = "draining"
            await self.on_stop()
            self.state = "stopped"
        except anyio.get_cancelled_exc_class():
            self.state = "stopped"
            raise
        except Exception as exc:
            self.state, self.error = "failed", exc
            self.log.exception("Actor failed", error=repr(exc))
            raise

    def _receive_ready(self) -> M | None:
        try:
            return self.inbox.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream):
            return None

    async def _handle_contained(self, message: M) -> None:
        try:
            await self.handle(message)
        except Exception as exc:
            request_ids = self.requests_concerned(message)
            if not request_ids:
                raise  # not attributable to a request: the actor fails, loudly
            self.log.exception(
                "Request failed", request_id=request_ids[0], message=type(message).__name__, error=repr(exc)
            )
            await self.fail_requests(request_ids, f"the {self.name} failed on this request: {exc!r}")

    async def on_start(self) -> None:
        """Runs before the actor reports ready."""

    async def on_stop(self) -> None:
        """Runs after the inbox closed and drained."""

    async def handle(self, message: M) -> None:
        raise NotImplementedError

    async def after_messages(self) -> None:
        """Runs each time the inbox has no message ready. An exception here fails the actor."""

    def requests_concerned(self, message: M) -> tuple[str, ...]:
        """The requests a failure handling `message` concerns alone: by default the message's
        `request_id`; () for a message about the engine as a whole (a step, the block pool)."""
        request_id = getattr(message, "request_id", None)
        return (request_id,) if isinstance(request_id, str) else ()

    async def fail_requests(self, request_ids: tuple[str, ...], message: str) -> None:
        """End `request_ids` with a typed error (`internal_error`); the others go on. The default
        cannot, so the failure is not contained and the actor fails."""
        raise RuntimeError(f"the {self.name} cannot fail requests alone: {message}")
