"""A KV connector plugin for tests/test_disaggregation.py, loaded by the replica processes
(`plugins: [disagg_test_plugins]`, tests/ on their PYTHONPATH): the default connector, whose
sends wait `send_delay` seconds first, so that a test can act while a transfer is under way; and
one whose receive, like nixl's, learns of a dead sender only through `abort`."""

from __future__ import annotations

import threading
import time

from pydantic import BaseModel, ConfigDict, Field

from cadenza.kv_connectors.torch_distributed import TorchDistributedConnector
from cadenza.plugins.hookspecs import hookimpl


class SlowSendOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    send_delay: float = Field(0.0, ge=0)


class SlowSendConnector(TorchDistributedConnector):
    name = "slow_send_test"
    options_model = SlowSendOptions

    def send(self, transfer):
        time.sleep(self.options.send_delay)
        return super().send(transfer)


class DeafReceiveConnector(SlowSendConnector):
    """Sends late, like `slow_send_test`; its receive waits, as nixl's does, for word that never
    comes from a dead sender: it ends only by `abort` (or after the peers' timeout)."""

    name = "deaf_receive_test"

    def join(self, peers):
        super().join(peers)
        self._wait_seconds = peers.timeout
        self._aborted = threading.Event()

    def receive(self, transfer):
        if self._aborted.wait(self._wait_seconds):
            from cadenza.kv_connectors.base import KVTransferError

            raise KVTransferError(f"transfer {transfer.transfer_id}: aborted, its sender died")
        return super().receive(transfer)

    def abort(self, transfer_id):
        self._aborted.set()


@hookimpl
def register_kv_connectors(register) -> None:
    register(SlowSendConnector.name, SlowSendConnector)
    register(DeafReceiveConnector.name, DeafReceiveConnector)
