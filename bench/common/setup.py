"""What every bench command sets up before it measures: the engine flags it shares with `cadenza
serve`, and the process it runs in (logging, line-buffered output, the quiet-machine policy).

Read by `bench/cli.py` (the parser and its runner), `common/device.py` (the flags as config
overrides) and `serving/serve_arms.py` (each arms bench sets up its own process), so that none of
them imports the command line. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import argparse
import os
import sys

# The engine flags `cadenza serve` has too, from one table (config/flags.py), with what the bench adds.
ENGINE_FLAGS = ("--device", "--load-format", "--attention-backend", "--cuda-graphs", "--max-num-seqs", "--kv-cache-memory",
                "--max-model-len", "--block-size")  # fmt: skip
ENGINE_FLAG_NOTES = {
    "--device": "The peers run on the same device.",
    "--load-format": "With dummy, --model names a config.json, a directory holding one, or a shipped shape "
                     "(smollm2-135m, qwen3-0.6b, llama-3.2-1b, llama-3.1-8b), seeded by --seed; transformers gets "
                     "the very same weights.",
    "--attention-backend": "Default on CUDA: triton.",
    "--max-num-seqs": "Default: the config's, raised to the bench's batch.",
    "--kv-cache-memory": "Default on CUDA: the blocks the work holds at once, within the free GPU memory.",
}


def setup_process(args: argparse.Namespace):
    """Logging and line-buffered output; returns the quiet-machine policy."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # progress shows as it happens, even in a file
    from cadenza.bench.common.quiet import QuietPolicy
    from cadenza.config.logging_setup import configure_logging

    configure_logging("info" if args.verbose else "warning", "console")
    return QuietPolicy(threshold=args.quiet_threshold / 100, max_repeats=args.max_repeats,
                       max_wait_seconds=args.max_wait, enabled=not args.no_quiet_check)
