"""The prefix cache's tiers below the KV budget, built from `cache.host_size`, `cache.disk_path`,
`cache.disk_size` and each tier's eviction policy (`cache.host_eviction_policy`,
`cache.disk_eviction_policy`; docs/kv-tiers.md): host first (faster), then disk; none when both are off,
when prefix caching is off, or under tensor parallelism (rank 0 holds only its heads' share of a
block, and the other ranks' caches are not reachable from here yet)."""

from __future__ import annotations

import structlog

from cadenza.kv_connectors.blocks import cache_tensors
from cadenza.kv_tiers import DiskTier, HostTier, TierStore, model_identity

log = structlog.get_logger(__name__)


def build_tiers(runtime) -> list[TierStore]:
    cache = runtime.config.cache
    if cache.host_size is None and cache.disk_path is None:
        return []
    if not cache.enable_prefix_caching:
        log.warning("KV tiers are off: they keep prefix-cache blocks, and cache.enable_prefix_caching is false")
        return []
    if runtime.parallel is not None:
        log.warning("KV tiers are off: not yet with tensor parallelism",
                    tensor_parallel_size=runtime.config.parallel.tensor_parallel_size)  # fmt: skip
        return []
    tiers: list[TierStore] = []
    if cache.host_size is not None:
        tiers.append(HostTier(cache.host_size_bytes, runtime.make_eviction_policy("host")))
    if cache.disk_path is not None:
        tiers.append(DiskTier(cache.disk_path, cache.disk_size_bytes, runtime_identity(runtime),
                              runtime.make_eviction_policy("disk")))  # fmt: skip
    return tiers


def runtime_identity(runtime) -> bytes:
    """The model identity of `runtime`'s blocks: its weights, dtype, block size, KV dtype and TP shape."""
    tensors = cache_tensors(runtime.runner.kv_caches)
    kv_dtype = ",".join(str(t.dtype).removeprefix("torch.") for t in tensors[:2])  # int8 caches: data, scales
    return model_identity(
        runtime.loaded.source,
        dtype=str(runtime.loaded.dtype).removeprefix("torch."),
        block_size=runtime.block_size,
        kv_dtype=kv_dtype,
        tensor_parallel_size=runtime.config.parallel.tensor_parallel_size,
    )
