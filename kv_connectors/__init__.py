"""KV connectors: how a prefill replica's KV-cache blocks reach a decode replica.

- `base.py`: the contract (`KVConnector`), what a transfer names (`BlockTransfer`), how a connector
  meets its peers (`ConnectorPeers`), and the typed errors.
- `blocks.py`: a cache's blocks as bytes: which tensors hold a block, gathering blocks into one
  payload and scattering one back (torch-free callers: the connectors).
- `torch_distributed.py`: the default, point-to-point sends in a process group of its own (gloo on
  the CPU, NCCL between GPUs).
- `nixl.py`: NVIDIA's NIXL (`pip install nixl`): the prefill side writes straight into the decode
  side's registered cache memory; imported only when selected.
- `builtins.py`: registers both through the `register_kv_connectors` hook, as a plugin would.

docs/scale-out.md ("Prefill/decode disaggregation") describes the feature.

May import: plugins/ and the layers below it. Not policies/, its neighbour on this floor;
cluster/ drives the connectors.
"""
