"""`cadenza bench`: seeded offline workloads, peer engines, machine ceilings and quiet-machine checks.

    python -m cadenza.bench.cli throughput --num-requests 16 --compare hf
    python -m cadenza.bench.cli latency

Modules: `workload` (the seeded requests), `quiet` (other processes' CPU share from /proc),
`ceilings` (memory bandwidth, matmul rates, the model's predicted step times), `engines` (cadenza
and its peers behind one `run(workload)` call), `throughput`, `latency`, `report` (tables, JSON),
`cli` (the `bench` subcommands).
"""
