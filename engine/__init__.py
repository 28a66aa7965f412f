"""The engine: `AsyncEngine` (`async_engine.py`) wires the five actors of actors/ with typed,
bounded channels over a `Runtime`, behind `generate`, `encode` and `abort`; `streams.py` holds the
per-request output streams a caller reads.

May import: runtime/, actors/ and everything below. cluster/, api/, llm and the CLI import it.
"""
