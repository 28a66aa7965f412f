"""Frames between the server and its data-parallel replicas: a 4-byte length, then a pickle.

Per request, not per step: a frame carries a request to a replica, an abort, or a batch of every
output a replica had ready (so a busy replica sends one frame per step, not one per token).
Both ends are cadenza processes of one deployment, on loopback or a trusted network.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import anyio
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

_LENGTH = struct.Struct("!I")


class FrameStream:
    def __init__(self, stream: ByteStream) -> None:
        self.stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._send_lock = anyio.Lock()  # several tasks send; a frame must go out whole

    async def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        async with self._send_lock:
            await self.stream.send(_LENGTH.pack(len(data)) + data)

    async def receive(self) -> Any:
        (length,) = _LENGTH.unpack(await self._reader.receive_exactly(_LENGTH.size))
        return pickle.loads(await self._reader.receive_exactly(length))

    async def aclose(self) -> None:
        await self.stream.aclose()
