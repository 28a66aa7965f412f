"""One engine in this process, no server: `cadenza bench throughput` (a seeded workload through
cadenza and its peers), `cadenza bench latency` (batch-1 decode, prefill, batch-N decode), next to
`ceilings` (this machine's memory bandwidth and matmul rates, the model's step times under them),
and `model_step` (`ModelRunner.execute` alone, no actors around it).

Imports: `common/` and `peers/`.
"""
