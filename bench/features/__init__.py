"""What one engine feature costs or gains, each its own `python -m` command: `speculative` (batch-1
decode with and without speculative decoding, over `edit_workload`'s documents), `step_rows` (what
one more row costs in a model step: the price of verifying guesses), `structured` (a grammar's share
of a decode step, compile time per schema), `sessions` (time to first token of a long conversation's
turns, with prefix reuse and without), `kv_tiers` (a long prompt's TTFT computed, and read back from
the disk tier by a restarted engine).

Imports: `common/` and `offline/` (the model step).
"""
