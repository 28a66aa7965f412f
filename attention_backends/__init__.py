"""Attention over the paged KV cache: the contract (`base.py`: `AttentionBackend`,
`AttentionMetadata`) and the built-in backends (`eager`, `torch_sdpa`, `triton`, `xformers`),
registered through the plugin hooks like any third-party backend (`builtins.py`). A backend
prepares indices and picks a kernel; the kernels themselves live in kernels/.

Models call a backend through its contract, so this layer sits below models/. May import:
plugins/ (the hook markers), kernels/, threads/, config/ and the root's plain data.
"""
