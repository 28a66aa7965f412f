"""The `nixl` KV connector: NVIDIA's NIXL (https://github.com/ai-dynamo/nixl, `pip install nixl`).

Each replica registers its KV cache with a NIXL agent (UCX backend: shared memory or TCP between
processes on the CPU, RDMA and GPU memory where the hardware has them) and publishes the agent's
metadata and its cache's addresses in the deployment's store; at `join` it loads every peer's.
A transfer is one-sided: the prefill side WRITEs each (layer, keys or values, block) region of its
cache straight into the decode side's matching region, with no staging copy, then NIXL notifies the
decode side ("cadenza-kv <id> ok", or "failed" when the write did not complete), which is all
`receive` waits for. Registering a CPU cache makes its pages resident.

`nixl` is imported only when this connector is built; selected where it is not installed, start-up
fails with `KVConnectorUnavailableError` naming the package. A prefill side that dies sends no
notification; the front-end, which sees its replica die, `abort`s the decode side's receive, which
then fails at once and gives its blocks back (a sender that hangs alive is waited for up to the
timeout).
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time

import structlog
import torch

from cadenza.kv_connectors.base import (
    BlockTransfer,
    ConnectorPeers,
    KVConnector,
    KVConnectorUnavailableError,
    KVTransferError,
)
from cadenza.kv_connectors.blocks import cache_tensors

log = structlog.get_logger(__name__)

POLL_SECONDS = 0.0005


class NixlConnector(KVConnector):
    name = "nixl"

    @classmethod
    def check_available(cls) -> None:
        if importlib.util.find_spec("nixl") is None:
            raise KVConnectorUnavailableError(
                "KV connector 'nixl' needs the `nixl` package, which is not installed here: pip install nixl "
                "(or choose parallel.disaggregation.connector: torch_distributed)"
            )

    def __init__(self, kv_caches: list, **kwargs) -> None:
        super().__init__(kv_caches, **kwargs)
        self.tensors = cache_tensors(kv_caches)
        self.agent = None
        self.timeout = 60.0
        self._remote: dict[int, tuple[str, list[dict]]] = {}  # rank -> (agent name, its cache regions)
        self._notes: dict[int, str] = {}  # transfer id -> "ok" / "failed", as they arrive
        self._aborted: set[int] = set()  # transfers whose sender died (`abort`)
        self._lock = threading.Lock()  # one thread drains NIXL's notifications at a time

    def join(self, peers: ConnectorPeers) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.timeout = peers.timeout
        self.agent = nixl_agent(f"cadenza-kv-{peers.rank}", nixl_agent_config(backends=["UCX"]))
        self.agent.register_memory(self.tensors)
        peers.store.set(f"nixl/{peers.rank}/metadata", self.agent.get_agent_metadata())
        peers.store.set(f"nixl/{peers.rank}/layout", json.dumps(_layout(self.tensors)))
        for rank in range(peers.world_size):
            if rank == peers.rank:
                continue
            # A store's `get` waits for the key, up to the store's own timeout.
            name = self.agent.add_remote_agent(peers.store.get(f"nixl/{rank}/metadata"))
            self._remote[rank] = (name, json.loads(peers.store.get(f"nixl/{rank}/layout")))
        log.info("KV connector joined", connector=self.name, rank=peers.rank, world_size=peers.world_size)

    def send(self, transfer: BlockTransfer) -> int:
        name, remote_layout = self._remote[transfer.destination]
        local = _regions(_layout(self.tensors), transfer.source_blocks)
        remote = _regions(remote_layout, transfer.destination_blocks)
        mem = "VRAM" if self.tensors[0].device.type == "cuda" else "DRAM"
        note = f"cadenza-kv {transfer.transfer_id}"
        handle = None
        try:
            handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, mem),
                                                self.agent.get_xfer_descs(remote, mem), name, f"{note} ok".encode())
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KVTransferError(f"transfer {transfer.transfer_id}: the write to replica "
                                          f"{transfer.destination} did not finish in {self.timeout:.0f}s")
                time.sleep(POLL_SECONDS)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise KVTransferError(f"transfer {transfer.transfer_id}: NIXL reported {state} writing to replica "
                                      f"{transfer.destination}")
        except Exception as exc:
            try:
                self.agent.send_notif(name, f"{note} failed".encode())
            except Exception:
                pass  # the peer is gone: its receive fails on its own
            if isinstance(exc, KVTransferError):
                raise
            raise KVTransferError(f"transfer {transfer.transfer_id} to replica {transfer.destination}: {exc!r}") from exc
        finally:
            if handle is not None:
                self.agent.release_xfer_handle(handle)
        return sum(size for _, size, _ in local)

    def receive(self, transfer: BlockTransfer) -> int:
        deadline = time.monotonic() + self.timeout
        while True:
            with self._lock:
                for messages in self.agent.get_new_notifs().values():
                    for message in messages:
                        prefix, _, rest = message.decode(errors="replace").partition(" ")
                        if prefix == "cadenza-kv" and " " in rest:
                            transfer_id, status = rest.split(" ", 1)
                            self._notes[int(transfer_id)] = status
                status = self._notes.pop(transfer.transfer_id, None)
                aborted = transfer.transfer_id in self._aborted
                self._aborted.discard(transfer.transfer_id)
            if aborted and status != "ok":
                raise KVTransferError(f"transfer {transfer.transfer_id}: replica {transfer.source} died before "
                                      "its blocks arrived")
            if status == "ok":
                regions = _regions(_layout(self.tensors), transfer.destination_blocks)
                return sum(size for _, size, _ in regions)
            if status is not None:
                raise KVTransferError(f"transfer {transfer.transfer_id}: replica {transfer.source} could not write its blocks")
            if time.monotonic() > deadline:
                raise KVTransferError(f"transfer {transfer.transfer_id}: nothing from replica {transfer.source} "
                                      f"in {self.timeout:.0f}s")
            time.sleep(POLL_SECONDS)

    def abort(self, transfer_id: int) -> None:
        with self._lock:
            self._aborted.add(transfer_id)

    def close(self) -> None:
        self.agent = None


def _layout(tensors: list[torch.Tensor]) -> list[dict]:
    """Where each cache tensor lives: its address, the byte strides of its keys/values and block
    dimensions, a block's bytes, and its device (what a peer needs to address its regions)."""
    return [{"address": t.data_ptr(), "kv_stride": t.stride(0) * t.element_size(),
             "block_stride": t.stride(1) * t.element_size(), "block_bytes": t[0, 0].numel() * t.element_size(),
             "device": max(t.get_device(), 0)} for t in tensors]  # fmt: skip


def _regions(layout: list[dict], blocks) -> list[tuple[int, int, int]]:
    """(address, bytes, device) of every (tensor, keys or values, block) region, in payload order."""
    return [(t["address"] + kv * t["kv_stride"] + b * t["block_stride"], t["block_bytes"], t["device"])
            for t in layout for kv in (0, 1) for b in blocks]  # fmt: skip
