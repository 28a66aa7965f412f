"""A server under load, as its clients see it: `serve` (`cadenza bench serve`: Poisson arrivals over
WebSocket sessions and OpenAI HTTP, with `serve_clients`, `serve_process` and `stats`), the benches
of arms each on a launched `cadenza serve` (`serve_arms`; `router_bench`: routers under multi-turn
chats; `disagg_bench`: prefill and decode replicas against colocated ones), and `scale_out`
(tensor parallelism's step time, data parallelism's throughput, cache-aware routing).

Imports: `common/` only.
"""
