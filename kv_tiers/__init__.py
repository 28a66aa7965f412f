"""KV tiers: where prefix-cache blocks live below the KV budget, addressed by content.

- `store.py`: the contract (`TierStore`: `get`, `put`, membership by chained block hash); its
  counters are `stats.py`'s `TierStats`.
- `order.py`: `TierOrder`, a tier's eviction order from an eviction-policy plugin (by digest and
  position; the policy is built by runtime/tiers.py), its faults contained.
- `host.py`: `HostTier`, blocks in host memory (for GPU deployments).
- `disk.py`: `DiskTier`, one file a block in a directory per model identity, written atomically,
  checked on every read, bounded in its policy's order, shareable by replicas on one host.
- `identity.py`: `model_identity`, the digest that keeps a block from being read into another model.

A store moves bytes only: the tier agent (actors/tier_agent.py) gathers a block's payload out of the
KV cache and scatters it back. docs/kv-tiers.md describes the feature.

May import: config/ and plain data. Not policies/, kv_connectors/ or parsers/, its neighbours on
this floor.
"""

from cadenza.kv_tiers.disk import DiskTier
from cadenza.kv_tiers.host import HostTier
from cadenza.kv_tiers.identity import model_identity
from cadenza.kv_tiers.store import TierStats, TierStore

__all__ = ["DiskTier", "HostTier", "TierStats", "TierStore", "model_identity"]
