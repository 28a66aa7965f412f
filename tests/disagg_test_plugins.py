"""A KV connector plugin for tests/test_disaggregation.py, loaded by the replica processes
(`plugins: [disagg_test_plugins]`, tests/ on their PYTHONPATH): the default connector, whose
sends wait `send_delay` seconds first, so that a test can act while a transfer is under way."""

from __future__ import annotations

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


@hookimpl
def register_kv_connectors(register) -> None:
    register(SlowSendConnector.name, SlowSendConnector)
