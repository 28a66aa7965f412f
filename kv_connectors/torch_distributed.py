"""The default KV connector: point-to-point sends over torch.distributed, in a group of its own.

At `join` every replica builds one process group over the deployment's store (rank = replica
index): gloo on the CPU, NCCL between GPUs (`parallel.backend` picks another). It is not the
default group, so it sits beside a replica's own tensor-parallel group. A transfer is two messages
from the prefill side: a header [transfer id, payload bytes] and then the payload, the selected
blocks of every layer in one flat byte tensor (`blocks.py`), under tags derived from the transfer
id. A sender that cannot gather its blocks still sends the header, with -1 bytes, so the receiver
returns at once rather than at the timeout; a peer that dies closes its connections, which fails
the other side's wait at once (gloo: "Connection closed by peer"); anything else ends at `timeout`.
"""

from __future__ import annotations

from datetime import timedelta

import structlog
import torch

from cadenza.kv_connectors.base import BlockTransfer, ConnectorPeers, KVConnector, KVTransferError
from cadenza.kv_connectors.blocks import block_nbytes, cache_tensors, gather_blocks, scatter_blocks

log = structlog.get_logger(__name__)

_TAG_SPACE = 1 << 30  # gloo and NCCL tags are 32-bit; two a transfer


class TorchDistributedConnector(KVConnector):
    name = "torch_distributed"

    def __init__(self, kv_caches: list, **kwargs) -> None:
        super().__init__(kv_caches, **kwargs)
        self.tensors = cache_tensors(kv_caches)
        self.block_bytes = block_nbytes(self.tensors)
        self.group = None
        self.timeout = timedelta(seconds=60)
        self._wire = torch.device("cpu")  # where payloads travel: the cache's device under NCCL

    def join(self, peers: ConnectorPeers) -> None:
        import torch.distributed as dist

        self.timeout = timedelta(seconds=peers.timeout)
        joining = timedelta(seconds=peers.join_timeout)
        on_gpu = torch.device(self.device).type == "cuda"
        backend = peers.backend if peers.backend != "auto" else ("nccl" if on_gpu else "gloo")
        store = dist.PrefixStore("torch_distributed/", peers.store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = joining
            self.group = dist.ProcessGroupNCCL(store, peers.rank, peers.world_size, options)
            self._wire = torch.device(self.device)
        else:
            self.group = _gloo_group(store, peers, joining)
        # Every pair connects now, not at the first request's transfer; each transfer's wait then
        # has the shorter `timeout`.
        self.group.barrier().wait(joining)
        log.info("KV connector joined", connector=self.name, backend=backend, rank=peers.rank, world_size=peers.world_size)

    def send(self, transfer: BlockTransfer) -> int:
        tag = 2 * transfer.transfer_id % _TAG_SPACE
        try:
            payload = gather_blocks(self.tensors, transfer.source_blocks).to(self._wire)
        except Exception:
            self._send_header(transfer, -1, tag)  # the receiver stops waiting now
            raise
        self._send_header(transfer, payload.numel(), tag)
        self._wait(self.group.send([payload], transfer.destination, tag + 1), "send to", transfer)
        return payload.numel()

    def receive(self, transfer: BlockTransfer) -> int:
        tag = 2 * transfer.transfer_id % _TAG_SPACE
        header = torch.empty(2, dtype=torch.int64, device=self._wire)
        self._wait(self.group.recv([header], transfer.source, tag), "receive from", transfer)
        transfer_id, nbytes = header.tolist()
        if transfer_id != transfer.transfer_id:
            raise KVTransferError(f"transfer {transfer.transfer_id}: replica {transfer.source} sent transfer {transfer_id}")
        if nbytes < 0:
            raise KVTransferError(f"transfer {transfer.transfer_id}: replica {transfer.source} could not read its blocks")
        if nbytes != transfer.num_blocks * self.block_bytes:
            raise KVTransferError(f"transfer {transfer.transfer_id}: {nbytes} bytes announced for "
                                  f"{transfer.num_blocks} blocks of {self.block_bytes}")
        payload = torch.empty(nbytes, dtype=torch.uint8, device=self._wire)
        self._wait(self.group.recv([payload], transfer.source, tag + 1), "receive from", transfer)
        scatter_blocks(self.tensors, transfer.destination_blocks, payload)
        return nbytes

    def close(self) -> None:
        self.group = None  # its connections close with it

    def _send_header(self, transfer: BlockTransfer, nbytes: int, tag: int) -> None:
        header = torch.tensor([transfer.transfer_id, nbytes], dtype=torch.int64, device=self._wire)
        self._wait(self.group.send([header], transfer.destination, tag), "send to", transfer)

    def _wait(self, work, what: str, transfer: BlockTransfer) -> None:
        peer = transfer.destination if what == "send to" else transfer.source
        try:
            work.wait(self.timeout)
        except Exception as exc:  # a dead peer ("Connection closed by peer") or the timeout
            raise KVTransferError(f"transfer {transfer.transfer_id}: could not {what} replica {peer}: {exc}") from exc


def _gloo_group(store, peers: ConnectorPeers, timeout: timedelta):
    """A gloo group on the loopback interface when every replica is on this machine (a hostname
    may resolve to an address nobody listens on, e.g. 127.0.1.1), else gloo's default device."""
    import torch.distributed as dist

    try:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        if peers.loopback:
            options._devices = [dist.ProcessGroupGloo.create_device(interface=_loopback_interface())]
        else:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, peers.rank, peers.world_size, options)
    except AttributeError:  # a torch without the private options: its default device and timeout
        return dist.ProcessGroupGloo(store, peers.rank, peers.world_size, timeout)


def _loopback_interface() -> str:
    import socket

    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return "lo0" if "lo0" in names and "lo" not in names else "lo"
