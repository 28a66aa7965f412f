"""Tensor parallelism over torch.distributed, and the shape of a deployment.

- `groups.py`: the process group (backend, timeout, env:// rendezvous) and a rank's place in it.
- `partition.py`: which heads, MLP columns and vocabulary rows each rank holds (torch-free).
- `tensor_parallel.py`: slicing a loaded model to a rank's shard; the layers that all-reduce.
- `step_codec.py`: a step's inputs as one flat int tensor plus a header of shapes.
- `tp_runner.py`: rank 0's side: the model the `ModelRunner` drives, which sends every step first.
- `launch.py`: spawning the ranks on one machine, watching them, stopping them (the loop the
  other ranks run is runtime/worker.py).
- `lifecycle.py`: `ManagedProcess`, how every process cadenza starts (a rank, a replica, a replica
  on Ray) starts, reports ready, fails and stops; `LocalProcess`, a child of this process.
- `placement.py`: a deployment's shape (replicas x ranks) checked against the cores or GPUs;
  `disaggregation.py`: prefill/decode disaggregation's shape, checked up front.
- `errors.py`: the typed errors.

Replicas, routers and disaggregated engines, which run engines, are one layer up, in cluster/.

May import: speculative/, samplers/, models/, attention_backends/ and everything below. runner/,
runtime/ and cluster/ import it.
"""
