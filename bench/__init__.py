"""`cadenza bench`: seeded workloads, peer engines, machine ceilings, serving load and quiet checks.

    cadenza bench throughput --num-requests 16 --compare hf
    cadenza bench latency
    cadenza bench serve --request-rates 1 4 inf

Modules: `workload` (the seeded requests), `quiet` (other processes' CPU share from /proc),
`ceilings` (memory bandwidth, matmul rates, the model's predicted step times), `engines` (cadenza
and its peers behind one `run(workload)` call), `throughput`, `latency`, `serve` with
`serve_clients`, `serve_process` and `stats` (a server under Poisson load), `report` (tables,
JSON), `cli` (the `bench` subcommands).
"""
