"""The loop every tensor-parallel rank but 0 runs: receive a command, run the shard, repeat.

Started by our launcher (`python -m cadenza.runtime.worker`, the config in the environment) or by
`torchrun ... -m cadenza serve` (ranks other than 0 come here from the CLI). A rank leaves on STOP
(status 0), or when a collective fails or times out, which is how a dead rank 0 is noticed
(status 1): nothing keeps running after the engine is gone.
"""

from __future__ import annotations

import os
import sys

import structlog
import torch

from cadenza.config import CadenzaConfig, environment
from cadenza.parallel.groups import destroy_group, env_rank, init_group, loaded_barrier
from cadenza.parallel.step_codec import Command, Logits, Step, StepChannel

log = structlog.get_logger(__name__)

CONFIG_ENV = environment.PARALLEL_CONFIG.name  # the deployment config as JSON, set by `launch.py`


def run_worker(config: CadenzaConfig, rank: int, world_size: int) -> int:
    """Join the group as `rank`, load this rank's shard, serve commands until STOP; the exit status."""
    from cadenza.runner.device import resolve_device
    from cadenza.runtime.plugins import resolve_plugins
    from cadenza.runtime.shard import build_model_shard, set_rank_threads

    set_rank_threads(config, world_size)
    ctx = init_group(rank, world_size, resolve_device(config.model.device), config.parallel.backend,
                     config.parallel.timeout_seconds)  # fmt: skip
    try:
        shard = build_model_shard(config, resolve_plugins(config), ctx)
        loaded_barrier(ctx)  # every rank has its shard: rank 0 may start sending steps
        log.info("Tensor-parallel rank ready", rank=rank, world_size=world_size)
        serve_commands(shard.model, shard.kv_caches, shard.backend, StepChannel(ctx))
        log.info("Tensor-parallel rank stopping", rank=rank)
        return 0
    except Exception as exc:
        driver = ctx.peers[0] if ctx.peers else "unknown"
        log.error("Tensor-parallel rank failed (rank 0, the engine, gone or out of step?)", rank=rank,
                  rank_0=driver, error=repr(exc))  # fmt: skip
        return 1
    finally:
        destroy_group()


@torch.inference_mode()
def serve_commands(model, kv_caches, backend, channel: StepChannel) -> None:
    while True:
        message = channel.receive()
        match message:
            case Step(input_ids=ids, positions=positions, meta=meta):
                model(ids, positions, kv_caches, meta, backend)
            case Logits(hidden=hidden):
                model.lm_head(hidden)  # joins the gather on rank 0
            case Command.NOOP:
                continue
            case Command.STOP:
                return
            case _:
                raise RuntimeError(f"unexpected message {message!r}")


def main() -> int:
    from cadenza.config.logging_setup import configure_logging

    config = CadenzaConfig.model_validate_json(os.environ[CONFIG_ENV])
    configure_logging(config.logging.level, config.logging.format)
    rank, world_size = env_rank()
    return run_worker(config, rank, world_size)


if __name__ == "__main__":
    sys.exit(main())
