"""Scale-out: tensor parallelism over torch.distributed and data-parallel engine replicas.

- `groups.py`: the process group (backend, timeout, env:// rendezvous) and a rank's place in it.
- `partition.py`: which heads, MLP columns and vocabulary rows each rank holds (torch-free).
- `tensor_parallel.py`: slicing a loaded model to a rank's shard; the layers that all-reduce.
- `step_codec.py`: a step's inputs as one flat int tensor plus a header of shapes.
- `tp_runner.py`: rank 0's side: the model the `ModelRunner` drives, which sends every step first.
- `worker.py`: the loop ranks other than 0 run.
- `launch.py`: spawning the ranks on one machine, watching them, stopping them.
- `errors.py`: the typed errors.
- `lifecycle.py`: `ManagedProcess`, how every process cadenza starts (a rank, a replica, a replica on
  Ray) starts, reports ready, fails and stops; `LocalProcess`, a child of this process.
- `placement.py`: a deployment's shape (replicas x ranks) checked against the cores or GPUs.
- `router.py`: data parallelism's choice of replica (longest cached prefix by block hashes, else least loaded).
- `replicas.py`, `replica_server.py`, `ray_replicas.py`: starting replica processes (locally or under Ray
  actors), and what each runs.
- `dp_engine.py`, `replica_client.py`, `wire.py`: the server's `AsyncEngine`-like view of the
  replicas, its connection to each, and their frames.
- Prefill/decode disaggregation: `disaggregation.py` (the shape, checked up front), `pd_engine.py`
  (the server's side: a request's blocks brought from a prefill to a decode replica),
  `kv_transfer.py` (a replica's side: blocks held, its KV connector's half of each transfer; the
  connectors themselves are in `cadenza.kv_connectors`).

Imports point one way: lifecycle, placement <- launch, ray_replicas, replica_client <- dp_engine <- replicas;
disaggregation, kv_transfer <- replica_server; dp_engine <- pd_engine <- replicas.
"""
