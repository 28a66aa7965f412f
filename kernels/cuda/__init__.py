"""Small fused CUDA kernels in CUDA C, compiled by cupy's NVRTC at first use, each beside its torch
fallback: top-k/top-p masking (top_k_top_p.py) and rotary embedding fused with the KV-cache write
(rotary_kv.py). loader.py finds cupy, checks it matches torch's CUDA, compiles and decides.

Importing this package imports nothing heavy: cupy is imported at an op's first call on a CUDA
tensor, and every op runs its torch fallback where cupy or a GPU is missing.
"""
