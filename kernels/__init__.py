"""Every kernel, grouped by where it runs: `cpu/` (C++ built on first use, and the CPU's features
that pick a variant), `triton/` (Triton GPU kernels, tested under `TRITON_INTERPRET=1`) and `cuda/`
(small CUDA C kernels compiled by cupy's NVRTC). Beside them the torch references several kernels
share: `kv_layout.py` (the paged KV cache's layout, its reads and writes), `rotary.py`,
`top_k_top_p.py` and `rows.py`. Every kernel is optional: each caller has a PyTorch path.

May import: threads/, config/ and the root's plain data only.
"""
