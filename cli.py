"""The `cadenza` command line: generate text, inspect the configuration."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    from cadenza.config.flags import add_config_flags

    parser.add_argument("--config", help="deployment YAML file or preset name (default: built-in defaults)")
    add_config_flags(parser)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    from cadenza.config.flags import flag_overrides

    return {
        **flag_overrides(args),
        "server.host": getattr(args, "host", None),
        "server.port": getattr(args, "port", None),
        "server.api_key": getattr(args, "api_key", None),
    }


def _serve(args: argparse.Namespace) -> int:
    from cadenza.api.server import run_server
    from cadenza.config import ConfigError, load_config
    from cadenza.config.logging_setup import configure_logging
    from cadenza.parallel.groups import env_rank, launched_by_torchrun

    config = load_config(args.config, overrides=_overrides(args))
    configure_logging(config.logging.level, config.logging.format, secrets=[k.key for k in config.server.all_api_keys])
    if launched_by_torchrun() and env_rank()[1] != config.parallel.tensor_parallel_size:
        raise ConfigError(
            f"parallel.tensor_parallel_size: torchrun started {env_rank()[1]} ranks, so it must be "
            f"{env_rank()[1]}, not {config.parallel.tensor_parallel_size}"
        )
    if launched_by_torchrun() and env_rank()[0] != 0:
        # `torchrun ... -m cadenza serve`: rank 0 serves, every other rank runs its model shard.
        from cadenza.runtime.worker import run_worker

        return run_worker(config, *env_rank())
    run_server(config, ask=args.ask)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cadenza", description="cadenza LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    gen.add_argument("--system", help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--verbose", action="store_true", help="show the engine's logs on stderr")
    _add_config_flags(gen)

    serve = commands.add_parser("serve", help="serve the model over WebSocket sessions and an OpenAI-compatible API")
    _add_config_flags(serve)
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--api-key", help="require this bearer token on HTTP and WebSocket")
    serve.add_argument("--ask", metavar="QUESTION", help="once listening, ask the served model this (a demo) and keep serving")

    from cadenza.bench.cli import add_bench_parser

    add_bench_parser(commands)

    config = commands.add_parser("config", help="show the effective configuration or its reference")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="print the effective configuration as YAML")
    _add_config_flags(show)
    config_commands.add_parser("schema", help="print every configuration key with its type, default and meaning")
    return parser


def _generate(args: argparse.Namespace) -> int:
    """Stream the completion to stdout as the engine produces it."""
    import anyio

    from cadenza.config import load_config
    from cadenza.config.logging_setup import configure_logging
    from cadenza.engine.async_engine import AsyncEngine
    from cadenza.runtime.build import build_runtime
    from cadenza.sampling_params import SamplingParams

    config = load_config(args.config, overrides=_overrides(args))
    # Logs go to stderr and stay quiet below warnings unless asked, so stdout is the answer alone.
    level = config.logging.level if args.verbose else "warning"
    configure_logging(level, config.logging.format)
    runtime = build_runtime(config)
    prompt: Any = args.prompt
    if args.chat:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )

    async def stream() -> int:
        async with AsyncEngine.serve(runtime) as engine:
            async for out in engine.generate(prompt, params):
                sys.stdout.write(out.text)
                sys.stdout.flush()
                if out.finish_reason == "error":
                    print(f"\ncadenza: error: {out.error}", file=sys.stderr)
                    return 1
        sys.stdout.write("\n")
        return 0

    try:
        return anyio.run(stream)
    finally:
        runtime.close()  # tensor-parallel ranks end with the command


def _config(args: argparse.Namespace) -> int:
    from cadenza.config import config_reference, dump_config, load_config

    if args.config_command == "schema":
        print(config_reference())
    else:
        print(dump_config(load_config(args.config, overrides=_overrides(args))), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from cadenza.config import ConfigError
    from cadenza.kernels.cpu.loader import KernelUnavailableError
    from cadenza.models.errors import ModelLoadError
    from cadenza.plugins.errors import PluginError

    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "bench":
            from cadenza.bench.cli import run_bench

            return run_bench(args)
        return _config(args)
    except (ConfigError, ModelLoadError, KernelUnavailableError, PluginError, ValueError) as exc:
        print(f"cadenza: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `cadenza config schema | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
