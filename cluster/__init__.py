"""Engines of engines: data-parallel replicas behind one server, the router that picks a replica,
prefill/decode disaggregation, replicas under Ray.

- `replicas.py`: starting N replica processes (locally, or under Ray actors: `ray_replicas.py`)
  and the server's front end over them; `replica_server.py` is what each replica runs.
- `dp_engine.py`, `replica_client.py`, `wire.py`: the server's `AsyncEngine`-like view of the
  replicas, its connection to each, and their frames.
- `router.py`: which replica serves a request (longest cached prefix by block hashes, else least
  loaded).
- `pd_engine.py` (the server's side of disaggregation: a request's blocks brought from a prefill
  to a decode replica) and `kv_transfer.py` (a replica's side: blocks held, its KV connector's half
  of each transfer).

May import: engine/, runtime/ and everything below (parallel/ for process lifecycles and the
deployment's shape). Only api/, llm and the CLI import this layer.
"""
