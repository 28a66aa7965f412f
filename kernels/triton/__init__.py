"""Triton GPU kernels (paged attention, KV cache writes), each beside its torch reference.

Importing this package imports nothing heavy: each kernel module imports triton itself, and
attention_backends/ imports those modules only when the Triton backend is selected.
"""
