"""The `inference-gateway` command (also `python -m proxy`).

serve, simulate, check-config, the administration commands (keys, accounts, credits,
webhooks) and `policy replay`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path

import orjson

# What the parsers need, no more: each command imports what it runs in its handler (admin_cli
# and simulators.cli likewise), so `serve` loads no simulator and `simulate` no Redis.
from proxy import __version__, admin_cli
from proxy.config import Config, ConfigError, load_config, load_policies
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
    _policy_commands(commands)  # policy replay
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
    from proxy.runtime.master import serve

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
    shadow = f"; shadow policies: {', '.join(config.shadow.files)}" if config.shadow else ""
    print(f"ok: {len(config.backends)} backend(s), config folder {config.root}{shadow}")
    return 0


def _policy_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policy = subparsers.add_parser("policy", help="try a candidate policy set on recorded traffic")
    commands = policy.add_subparsers(title="policy commands", required=True)
    command = commands.add_parser(
        "replay", help="replay access-log lines through a candidate policies folder")
    command.add_argument("--log", action="append", required=True, metavar="FILE",
                        help="an access log (JSON lines; '-' for stdin), repeatable")
    command.add_argument("--policies", required=True, metavar="DIR",
                        help="the candidate policies folder (tiers.toml, prices.toml, ...; "
                        "a file it lacks is the live one, from --config)")
    command.add_argument("--config", default=".", metavar="DIR",
                        help="the gateway's config folder, whose policies/ fills in what the "
                        "candidate lacks (default: the current folder)")
    command.add_argument("--since", type=_moment, metavar="TIME",
                        help="only requests from this time (ISO 8601, e.g. 2026-11-27T00:00Z, "
                        "or Unix seconds)")
    command.add_argument("--until", type=_moment, metavar="TIME", help="only requests before it")
    command.add_argument("--top", type=int, default=10, metavar="N",
                        help="accounts listed (default 10)")
    command.add_argument("--json", action="store_true", help="one JSON document, for scripts")
    command.set_defaults(handler=_replay)


def _moment(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r}") from None


def _lines(paths: list[str]) -> Iterator[bytes]:
    for path in paths:
        if path == "-":
            yield from sys.stdin.buffer
            continue
        with Path(path).open("rb") as file:
            yield from file


def _replay(args: argparse.Namespace) -> int:
    from proxy.policy import replay

    try:
        policies = load_policies(args.policies, Path(args.config) / "policies")
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return 2
    try:
        lines = list(_lines(args.log))
    except OSError as exc:
        print(f"cannot read the log: {exc}", file=sys.stderr)
        return 2
    report = replay.Replay(policies).run(lines, args.since, args.until).report(args.top)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    else:
        print(replay.text(report))
    return 0
