"""Prefill/decode disaggregation's shape, checked up front (plain logic: no processes, no torch).

`parallel.disaggregation: {prefill: P, decode: D}` splits the `data_parallel_size` replicas into
P prefill replicas (indices 0..P-1) and D decode replicas (P..P+D-1); every replica is also the
connector rank of that index. What cannot work is refused before any process starts, with a
`ConfigError` naming each problem, like the data x tensor-parallel shape (`placement.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cadenza.config import CadenzaConfig
from cadenza.config.errors import ConfigError

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, slots=True)
class Roles:
    """Which replicas prefill and which decode, by replica index."""

    prefill: tuple[int, ...]
    decode: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.prefill) + len(self.decode)

    def role(self, index: int) -> str:
        return PREFILL if index in self.prefill else DECODE


def plan_disaggregation(config: CadenzaConfig) -> Roles | None:
    """The replicas' roles, None when disaggregation is off; a `ConfigError` listing every problem."""
    section, parallel = config.parallel.disaggregation, config.parallel
    if not section.enabled:
        return None
    prefill, decode, replicas = section.prefill, section.decode, parallel.data_parallel_size
    problems = []
    if prefill < 1 or decode < 1:
        problems.append(f"parallel.disaggregation: needs at least one prefill and one decode replica, got prefill "
                        f"{prefill}, decode {decode} (both 0 turns it off)")
    if prefill + decode != replicas:
        problems.append(f"parallel.disaggregation: prefill {prefill} + decode {decode} = {prefill + decode} replicas, "
                        f"but parallel.data_parallel_size is {replicas}; set data_parallel_size: {prefill + decode}")
    if parallel.launcher == "ray" and parallel.max_restarts > 0 and "max_restarts" in parallel.model_fields_set:
        problems.append(f"parallel.disaggregation: parallel.max_restarts {parallel.max_restarts} with launcher ray: a "
                        "restarted replica cannot rejoin its KV connectors' group; set max_restarts: 0 (left unset, "
                        "a disaggregated deployment's replicas are not restarted)")
    if parallel.tensor_parallel_size != 1:
        problems.append(f"parallel.disaggregation: tensor_parallel_size {parallel.tensor_parallel_size}: a replica's "
                        "KV cache must be whole in one process to be sent; use tensor_parallel_size: 1")
    if not config.cache.enable_prefix_caching:
        problems.append("parallel.disaggregation: needs cache.enable_prefix_caching: true (blocks are sent, skipped "
                        "and found by their prefix hashes)")
    if problems:
        raise ConfigError(problems)
    return Roles(tuple(range(prefill)), tuple(range(prefill, prefill + decode)))


def check_connector(config: CadenzaConfig, registries) -> type:
    """The configured connector class, available here; else a `ConfigError` naming the name or
    the missing package (`UnknownNameError` lists the registered names)."""
    from cadenza.kv_connectors.base import KVConnectorUnavailableError

    cls = registries.kv_connectors.get(config.parallel.disaggregation.connector)
    try:
        cls.check_available()
    except KVConnectorUnavailableError as exc:
        raise ConfigError(f"parallel.disaggregation.connector: {exc}") from exc
    return cls
