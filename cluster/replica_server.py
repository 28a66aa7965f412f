"""A data-parallel replica: one whole engine in its own process, serving one router connection.

`python -m cadenza.cluster.replica_server` (the config as JSON in the environment) builds its
runtime, starts an `AsyncEngine`, listens on a TCP port and prints `cadenza replica ready on
HOST:PORT blocks N`. It serves one router connection at a time (a reconnecting server finds its
cache warm) until it is terminated; started locally, it also ends when its parent dies
(PR_SET_PDEATHSIG; under Ray, `--exit-with-stdin`: when its actor's end of stdin closes), so a
replica never outlives its server. Messages in: ("generate", id, prompt, params,
priority), ("abort", id), ("metrics",). Out: ("out", [(id, GenerationOutput), ...]),
("metrics", snapshot).

In a disaggregated deployment (`--kv-peer RANK/WORLD@HOST:PORT`) the replica also builds its KV
connector and joins the others before it reports ready, and takes the kv_* messages of
`kv_transfer.py`; a request whose blocks it received lets go of them once it is running.
"""

from __future__ import annotations

import os
import re
import sys

import anyio
import structlog
from anyio.abc import SocketAttribute

from cadenza.cluster.kv_transfer import KVTransferAgent, join_connector
from cadenza.cluster.wire import FrameStream
from cadenza.config import CadenzaConfig, environment
from cadenza.engine.async_engine import AsyncEngine
from cadenza.engine.streams import GenerationOutput

log = structlog.get_logger(__name__)

CONFIG_ENV = environment.REPLICA_CONFIG.name
INDEX_ENV = environment.REPLICA_INDEX.name
HOST_ENV = environment.REPLICA_HOST.name  # where to listen: loopback unless a remote server connects
OUTBOX_CAPACITY = 1024
READY = re.compile(r"cadenza replica ready on (?P<host>\S+):(?P<port>\d+) blocks (?P<blocks>\d+)")
LIFELINE_FLAG = "--exit-with-stdin"
KV_PEER_FLAG = "--kv-peer"  # RANK/WORLD@HOST:PORT: this replica's place among the KV connectors
# A replica starts its own tensor-parallel group: none of a launcher's rendezvous variables leak in.
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def replica_command(
    config_json: str, index: int, *, host: str | None = None, lifeline: bool = False, extra_env: dict[str, str] | None = None,
    kv_peer: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start replica `index` (listening on `host`, loopback by
    default; `kv_peer`: its `--kv-peer` in a disaggregated deployment)."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env.update({CONFIG_ENV: config_json, INDEX_ENV: str(index), **(extra_env or {})})
    if host is not None:
        env[HOST_ENV] = host
    argv = [sys.executable, "-m", "cadenza.cluster.replica_server", *([LIFELINE_FLAG] if lifeline else [])]
    if kv_peer is not None:
        argv += [KV_PEER_FLAG, kv_peer]
    return argv, env


def error_output(request_id: str, code: str, message: str) -> GenerationOutput:
    return GenerationOutput(request_id, "", (), None, "error", 0, 0, 0, error=message, error_code=code)


async def serve_router(engine: AsyncEngine, frames: FrameStream, kv: KVTransferAgent | None = None) -> None:
    """Run the router's requests on `engine` until the connection closes (`kv`: this replica's
    side of disaggregation, if it has one)."""
    # Bounded: when the connection is slow, `run` waits here and the engine's streams coalesce.
    outbox_tx, outbox_rx = anyio.create_memory_object_stream[tuple[str, GenerationOutput]](OUTBOX_CAPACITY)
    running: dict[str, anyio.CancelScope] = {}

    async def run(request_id: str, prompt, params, priority: int) -> None:
        with anyio.CancelScope() as scope:
            running[request_id] = scope
            try:
                async for out in engine.generate(prompt, params, request_id=request_id, priority=priority):
                    if kv is not None:  # running: its own references keep any blocks it received
                        kv.release(request_id)
                    await outbox_tx.send((request_id, out))
            except Exception as exc:  # refused before any output (engine closed, id in use)
                await outbox_tx.send((request_id, error_output(request_id, "engine_failed", str(exc))))
            finally:
                if kv is not None:
                    kv.release(request_id)
        running.pop(request_id, None)

    async def write() -> None:
        async for item in outbox_rx:
            batch = [item]
            while True:
                try:
                    batch.append(outbox_rx.receive_nowait())
                except anyio.WouldBlock:
                    break
            await frames.send(("out", batch))

    async with anyio.create_task_group() as tg:
        tg.start_soon(write)
        try:
            while True:
                message = await frames.receive()
                match message:
                    case ("generate", request_id, prompt, params, priority):
                        tg.start_soon(run, request_id, prompt, params, priority)
                    case ("abort", request_id):
                        if request_id in running:
                            running[request_id].cancel()
                        elif kv is not None:  # aborted before it was sent here: its received blocks go
                            kv.release(request_id)
                    case ("metrics",):
                        await frames.send(("metrics", engine.metrics.snapshot(), engine.healthy))
                    case (kind, _, *_) if kv is not None and isinstance(kind, str) and kind.startswith("kv_"):
                        tg.start_soon(kv.handle, message, frames.send)
                    case _:
                        raise ValueError(f"replica got an unknown message {message!r}")
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, ConnectionError):
            log.info("Router disconnected; replica stopping")
        finally:
            tg.cancel_scope.cancel()
            if kv is not None:
                kv.release_all()


async def _main(config: CadenzaConfig, index: int, kv_peer: str | None = None) -> None:
    from cadenza.runtime.build import build_runtime

    runtime = build_runtime(config)
    connector = None
    try:
        async with AsyncEngine.serve(runtime, max_pending_tokens=config.server.max_pending_tokens) as engine:
            kv = None
            if kv_peer is not None:
                connector = await anyio.to_thread.run_sync(_join_connector, config, runtime, kv_peer)
                kv = KVTransferAgent(engine, connector)
            listener = await anyio.create_tcp_listener(local_host=os.environ.get(HOST_ENV, "127.0.0.1"), local_port=0)
            socket_listener = listener.listeners[0]
            host, port = socket_listener.extra(SocketAttribute.local_address)[:2]
            print(f"cadenza replica ready on {host}:{port} blocks {runtime.num_blocks}", flush=True)
            async with listener:
                while True:  # one router at a time; a server that reconnects finds the cache warm
                    stream = await socket_listener.accept()
                    log.info("Replica serving a router", replica=index)
                    await serve_router(engine, FrameStream(stream), kv)
    finally:
        if connector is not None:
            connector.close()
        runtime.close()


def _join_connector(config: CadenzaConfig, runtime, kv_peer: str):
    from cadenza.runtime.plugins import resolve_plugins

    plugins = resolve_plugins(config)
    cls = plugins.registries.kv_connectors.get(config.parallel.disaggregation.connector)
    return join_connector(cls, plugins, runtime, kv_peer, timeout=config.parallel.timeout_seconds,
                          backend=config.parallel.backend)


def main() -> int:
    from cadenza.config.logging_setup import configure_logging

    if LIFELINE_FLAG in sys.argv[1:]:
        from cadenza.parallel.lifecycle import exit_with_stdin

        exit_with_stdin()
    config = CadenzaConfig.model_validate_json(os.environ[CONFIG_ENV])
    configure_logging(config.logging.level, config.logging.format)
    structlog.contextvars.bind_contextvars(replica=int(os.environ.get(INDEX_ENV, 0)))
    argv = sys.argv[1:]
    kv_peer = argv[argv.index(KV_PEER_FLAG) + 1] if KV_PEER_FLAG in argv else None
    anyio.run(_main, config, int(os.environ.get(INDEX_ENV, 0)), kv_peer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
