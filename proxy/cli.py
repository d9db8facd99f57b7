"""The `inference-gateway` command (also `python -m proxy`).

serve, simulate, check-config, and the administration commands: keys, accounts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from proxy import __version__, admin_cli
from proxy.config import Config, ConfigError, load_config
from proxy.simulators import cli as simulators_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        result: int = handler(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader closed the pipe early (`keys create ... | head -n1`): it has what it
        # wanted; say nothing more, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inference-gateway", description="Policy-enforcing reverse proxy for GPU inference."
    )
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(title="commands")

    serve = commands.add_parser("serve", help="run the gateway")
    _config_option(serve)
    serve.add_argument("--host", help="listen address (default: [gateway] host)")
    serve.add_argument("--port", type=int, help="listen port (default: [gateway] port)")
    serve.add_argument("--workers", type=_positive, metavar="N",
                       help="HTTP worker processes (default: [gateway] workers, else one per CPU)")
    serve.set_defaults(handler=_serve)

    check = commands.add_parser("check-config", help="validate backends.toml and policies/")
    _config_option(check)
    check.set_defaults(handler=_check_config)

    simulate = commands.add_parser("simulate", help="run an upstream simulator (no GPU needed)")
    simulators_cli.add_arguments(simulate)
    simulate.set_defaults(handler=simulators_cli.run)

    admin_cli.add_commands(commands)  # keys create|list|revoke, accounts show
    return parser


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=".", metavar="DIR",
        help="folder holding backends.toml and policies/ (default: the working directory)",
    )


def _load(args: argparse.Namespace) -> Config | None:
    try:
        return load_config(args.config)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return None


def _serve(args: argparse.Namespace) -> int:
    from proxy.runtime.master import (
        serve,  # the server's imports are not needed by the other commands
    )

    config = _load(args)
    if config is None:
        return 1
    return serve(config, host=args.host, port=args.port, workers=args.workers)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _check_config(args: argparse.Namespace) -> int:
    config = _load(args)
    if config is None:
        return 1
    print(f"ok: {len(config.backends)} backend(s), config folder {config.root}")
    return 0
