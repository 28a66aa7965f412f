"""The model runner: one step's scheduled chunks to tensors, the model's forward pass, sampling.

`model_runner.py` (the runner core), `step_inputs.py` (a step's inputs packed on the host, sent in
one copy), `cuda_graphs.py` (decode steps padded to a bucket and replayed as CUDA graphs),
`kv_cache.py` (how many blocks to allocate, and the per-layer block tensors) and `device.py`
(`model.device`, `model.dtype` and `cache.dtype` as torch values).

May import: parallel/, speculative/, samplers/, models/, attention_backends/ and everything
below. actors/ and runtime/ import it.
"""
