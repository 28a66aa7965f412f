"""The KV connector contract: moving whole KV-cache blocks from a prefill replica to a decode replica.

Every replica of a disaggregated deployment builds the configured connector over its own KV cache
and `join`s the others at start-up, before it reports ready. Per request, once the prefill replica
has computed the prompt and the decode replica has reserved room, the front-end names one
`BlockTransfer` to both sides, and each calls its half at the same time, in a worker thread:
`send` on the prefill side, `receive` on the decode side. Both must return (or raise
`KVTransferError`) within the peers' timeout whatever the other side does, so that a replica that
dies mid-transfer fails its transfer instead of hanging it. The caller keeps every block the
transfer names held (not evicted, not reused) until both halves have returned.

A connector with an `options_model` is built with `options=` from `plugin_options[name]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel


class KVConnectorUnavailableError(RuntimeError):
    """The selected connector cannot run here (its package is missing); the message names it."""


class KVTransferError(RuntimeError):
    """A transfer failed: the peer died or stopped answering, or the payload did not match."""


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """One request's blocks from a prefill replica to a decode replica.

    `transfer_id` is unique in the deployment (the front-end numbers transfers; it doubles as a
    message tag). `source` and `destination` are connector ranks (a replica's index among all
    replicas). `source_blocks[i]` in the source's cache goes to `destination_blocks[i]` in the
    destination's: the same number of blocks, in prompt order.
    """

    transfer_id: int
    source: int
    destination: int
    source_blocks: tuple[int, ...]
    destination_blocks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.source_blocks) != len(self.destination_blocks):
            raise ValueError(f"transfer {self.transfer_id}: {len(self.source_blocks)} source blocks for "
                             f"{len(self.destination_blocks)} destination blocks")

    @property
    def num_blocks(self) -> int:
        return len(self.source_blocks)


@dataclass(frozen=True, slots=True)
class ConnectorPeers:
    """How a connector meets the other replicas: its `rank` among `world_size`, a key-value store
    every replica reaches (a `torch.distributed.Store`, its keys already prefixed for the
    connector, whose `get` waits up to `join_timeout`), `timeout` seconds for any wait on a peer
    during a transfer, `join_timeout` for `join` (replicas load their models at their own pace),
    `backend` (`parallel.backend`: auto, gloo or nccl) and whether every replica runs on this
    machine (`loopback`)."""

    rank: int
    world_size: int
    store: Any
    timeout: float
    join_timeout: float = 300.0
    backend: str = "auto"
    loopback: bool = True


class KVConnector(ABC):
    """Moves blocks of a paged KV cache between replicas.

    Built once per replica over its cache: `kv_caches` is the runner's list, one entry per layer
    (a tensor [2, num_blocks, block_size, kv_heads, head_dim], or an `Int8KVCache`); every replica
    of a deployment has the same layout. `join` is called once, then `send` and `receive` from
    worker threads, several at a time for different transfers; `close` once at shutdown.
    """

    name: ClassVar[str]
    options_model: ClassVar[type[BaseModel] | None] = None

    def __init__(self, kv_caches: list, *, block_size: int, device: Any, options: BaseModel | None = None) -> None:
        self.check_available()
        if options is None and self.options_model is not None:
            options = self.options_model()
        self.options = options
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    @classmethod
    def check_available(cls) -> None:
        """Raise `KVConnectorUnavailableError` naming what is missing; the default runs anywhere.
        Called before any replica starts, so a missing package fails start-up at once."""

    @abstractmethod
    def join(self, peers: ConnectorPeers) -> None:
        """Connect to every other replica; returns once all have joined (within `peers.timeout`)."""

    @abstractmethod
    def send(self, transfer: BlockTransfer) -> int:
        """Prefill side: deliver `transfer.source_blocks` of this cache to the destination's
        `destination_blocks`; returns the bytes moved. Raises `KVTransferError`."""

    @abstractmethod
    def receive(self, transfer: BlockTransfer) -> int:
        """Decode side: return once `transfer.destination_blocks` of this cache hold the source's
        blocks; returns the bytes received. Raises `KVTransferError` (the blocks' contents are
        then undefined: the caller frees them unhashed)."""

    def abort(self, transfer_id: int) -> None:
        """Decode side: the sender of transfer `transfer_id` is known to be dead (the front-end saw
        its replica die). A `receive` of it under way, or called later, raises `KVTransferError`
        now instead of at the timeout, so its blocks go back at once. Called from another thread
        than the receive's. The default does nothing, which suits a connector whose receive fails
        as soon as its peer dies (gloo's connection closes); one that waits for a message a dead
        peer never sends (nixl's notification) overrides it."""

    def close(self) -> None:
        """Release the connector's resources (process group, registered memory)."""
