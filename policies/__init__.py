"""Pluggable policies: which cached KV blocks to evict (`eviction.py`: the contract and the
built-in `lru`, `lfu`, `fifo`), and what a long conversation does when it outgrows its window
(`context.py`: context policies and providers). Each kind registers through the plugin hooks,
its built-ins exactly as a third-party plugin would.

May import: plugins/, models/ (the tokenizer and prompts), the layers below them, and the root's
plain data. Not kv_connectors/, its neighbour on this floor.
"""
