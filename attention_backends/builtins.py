"""Registers the built-in attention backends exactly as a third-party plugin would."""

from cadenza.attention_backends.eager import EagerBackend
from cadenza.attention_backends.torch_sdpa import TorchSDPABackend
from cadenza.attention_backends.triton_paged import TritonPagedBackend
from cadenza.attention_backends.xformers import XFormersBackend
from cadenza.plugins.hookspecs import hookimpl


@hookimpl
def register_attention_backends(register) -> None:
    for backend in (TorchSDPABackend, EagerBackend, XFormersBackend, TritonPagedBackend):
        register(backend.name, backend)
