"""Registers the built-in KV connectors exactly as a third-party plugin would.

Importing this module imports neither torch.distributed's groups nor nixl: each connector
imports what it needs when it is built.
"""

from cadenza.kv_connectors.nixl import NixlConnector
from cadenza.kv_connectors.torch_distributed import TorchDistributedConnector
from cadenza.plugins.hookspecs import hookimpl


@hookimpl
def register_kv_connectors(register) -> None:
    for connector in (TorchDistributedConnector, NixlConnector):
        register(connector.name, connector)
