"""Operator commands on keys and accounts: `keys create|list|revoke`, `accounts show`,
`credits ...`, `webhooks add|list|remove|alerts`.

They talk to the gateway's Redis directly (the same store the workers read), found as
GATEWAY_REDIS_URL, else `[gateway] redis_url`, else the embedded server's unix socket under the
data directory, which only exists while `serve` runs. A new key is printed once, and it is all that
`keys create` writes to stdout, so `KEY=$(inference-gateway keys create ...)` captures it; its id
and the reminder to store it go to stderr. Nothing here ever prints a digest, and a key given on
the command line is never echoed back.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from proxy.config import Config, ConfigError, load_config
from proxy.credits.budgets import PERIODS, budgets, utc_text
from proxy.credits.pricing import format_credits, parse_credits
from proxy.errors import GatewayError
from proxy.identity.principal import GUEST_TIER
from proxy.store.redis_process import RedisProcess

# Redis and what stands on it load when a command runs, not here: every `inference-gateway`
# command (serve and simulate too) builds these parsers.
if TYPE_CHECKING:
    from proxy.credits.ledger import Ledger
    from proxy.credits.webhooks import Webhooks
    from proxy.identity.keystore import KeyRecord, KeyStore

__all__ = ["DEFAULT_TIERS", "add_commands", "known_tiers", "redis_url_for"]

DEFAULT_TIERS: frozenset[str] = frozenset({"basic", "pro", "max"})

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

Action = Callable[[argparse.Namespace, Config, "KeyStore"], Awaitable[int]]


def known_tiers(config: Config) -> set[str]:
    """Tiers a key may be issued for: those in policies/tiers.toml, except the guests' own."""
    return set(config.policies.tiers.tiers) - {GUEST_TIER}


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = subparsers.add_parser("keys", help="create, list and revoke API keys")
    key_commands = keys.add_subparsers(title="keys commands", required=True)

    create = key_commands.add_parser(
        "create", help="issue a new key: printed once, alone on stdout (its id on stderr)")
    create.add_argument("--account", required=True, help="account the key bills to")
    create.add_argument("--tier", required=True, help="tier name, e.g. basic, pro, max")
    create.add_argument("--label", default="", help="free text to recognise the key by")
    _common(create, _create)

    listing = key_commands.add_parser("list", help="list keys (never shows a key)")
    listing.add_argument("--account", help="only this account's keys")
    _common(listing, _list)

    revoke = key_commands.add_parser("revoke", help="revoke a key at once, everywhere")
    revoke.add_argument("key_or_id", metavar="KEY_OR_ID", help="the key, or its id (key_...)")
    _common(revoke, _revoke)

    accounts = subparsers.add_parser("accounts", help="inspect accounts")
    account_commands = accounts.add_subparsers(title="accounts commands", required=True)
    show = account_commands.add_parser("show", help="an account and its keys")
    show.add_argument("account", metavar="ACCOUNT")
    _common(show, _show)

    credits = subparsers.add_parser("credits", help="top up, adjust and audit credit balances")
    credit_commands = credits.add_subparsers(title="credits commands", required=True)
    add = credit_commands.add_parser("add", help="add credits (negative: an adjustment)")
    add.add_argument("--account", required=True)
    add.add_argument("--amount", required=True, metavar="CREDITS",
                     help="credits, e.g. 10 or 2.5 (exact to 6 decimal places)")
    add.add_argument("--reason", default="top-up")
    add.add_argument("--idempotency-key", metavar="KEY",
                     help="made once per key and account for 24 h (the admin API's "
                          "Idempotency-Key: the same top-up whichever way it comes)")
    _common(add, _credits_add)
    reconcile = credit_commands.add_parser(
        "reconcile", help="prove from the journal that balances, holds and spend add up")
    reconcile.add_argument("--account", help="only this account")
    _common(reconcile, _credits_reconcile)
    sweep = credit_commands.add_parser("sweep", help="release expired holds now")
    _common(sweep, _credits_sweep)
    budget = credit_commands.add_parser(
        "budget", help="set or remove a spend budget that resets each UTC day, week or month")
    budget.add_argument("--account", required=True)
    budget.add_argument("--period", required=True, choices=sorted(PERIODS))
    budget.add_argument("--amount", metavar="CREDITS", help="the cap, e.g. 50 (omit: remove it)")
    budget.add_argument("--key", metavar="KEY_ID", help="a key's budget (at most its account's)")
    budget.add_argument("--postpaid", choices=("on", "off"),
                        help="on: no balance check, the account runs on its budgets alone")
    _common(budget, _credits_budget)
    below = credit_commands.add_parser(
        "alert-below", help="alert (webhooks) when the balance falls under an amount")
    below.add_argument("--account", required=True)
    below.add_argument("--amount", metavar="CREDITS", help="the threshold (omit: remove it)")
    _common(below, _credits_alert_below)

    hooks = subparsers.add_parser(
        "webhooks", help="endpoints that get budget and balance alerts, and their deliveries")
    hook_commands = hooks.add_subparsers(title="webhooks commands", required=True)
    hook_add = hook_commands.add_parser(
        "add", help="register an endpoint (prints its signing secret, once)")
    hook_add.add_argument("--url", required=True, help="http(s) URL the alerts are POSTed to")
    hook_add.add_argument("--account", help="only this account's alerts (default: every one's)")
    _common(hook_add, _webhooks_add)
    hook_list = hook_commands.add_parser("list", help="the endpoints (never their secrets)")
    _common(hook_list, _webhooks_list)
    hook_remove = hook_commands.add_parser("remove", help="stop sending to an endpoint")
    hook_remove.add_argument("endpoint_id", metavar="ENDPOINT_ID", help="we_...")
    _common(hook_remove, _webhooks_remove)
    hook_alerts = hook_commands.add_parser(
        "alerts", help="an account's alerts, newest first, with each delivery's state")
    hook_alerts.add_argument("--account", required=True)
    hook_alerts.add_argument("--count", type=int, default=20)
    _common(hook_alerts, _webhooks_alerts)


def _common(parser: argparse.ArgumentParser, action: Action) -> None:
    parser.add_argument(
        "--config", default=".", metavar="DIR",
        help="folder holding backends.toml and policies/ (default: the working directory)",
    )
    parser.set_defaults(handler=lambda args: _run(args, action))


def redis_url_for(config: Config) -> tuple[str, bool]:
    """The Redis URL the gateway uses, and whether it is the embedded server."""
    url = os.environ.get("GATEWAY_REDIS_URL") or config.gateway.redis_url
    if url:
        return url, False
    return RedisProcess(config.data_dir / "redis").url, True


def _run(args: argparse.Namespace, action: Action) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"config error: {problem}", file=sys.stderr)
        return EXIT_FAIL
    return asyncio.run(_with_store(args, config, action))


async def _with_store(args: argparse.Namespace, config: Config, action: Action) -> int:
    from redis.exceptions import RedisError

    from proxy.identity.keystore import KeyStore
    from proxy.store.client import connect_redis

    url, embedded = redis_url_for(config)
    redis = connect_redis(url, timeout_s=10.0)
    try:
        try:
            await redis.ping()
        except (RedisError, OSError):
            if embedded:
                print(f"cannot reach the embedded Redis at {url}: it belongs to the gateway, "
                      f"which must be running (inference-gateway serve --config {args.config}); "
                      "or set GATEWAY_REDIS_URL", file=sys.stderr)
            else:
                print(f"cannot reach Redis at {_public_url(url)}", file=sys.stderr)
            return EXIT_FAIL
        store = KeyStore(redis, config.policies.auth.keys)
        try:
            return await action(args, config, store)
        except RedisError as exc:
            print(f"Redis error: {type(exc).__name__}", file=sys.stderr)
            return EXIT_FAIL
    finally:
        await redis.aclose()


def _public_url(url: str) -> str:
    """The URL without its password (a Redis URL may carry one)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


async def _create(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    from proxy.identity.keystore import ACCOUNT_PATTERN, LABEL_MAX

    tiers = known_tiers(config)
    if args.tier not in tiers:
        print(f"unknown tier {args.tier!r} (known: {', '.join(sorted(tiers))})", file=sys.stderr)
        return EXIT_USAGE
    try:
        raw, record = await store.create(args.account, args.tier, args.label)
    except ValueError:
        print(f"account must match {ACCOUNT_PATTERN}; label at most {LABEL_MAX} printable "
              "characters", file=sys.stderr)
        return EXIT_USAGE
    # The one and only time this key is shown: alone on stdout, so `KEY=$(...)` captures it.
    print(raw, flush=True)
    print(f"id: {record.id}  account: {record.account}  tier: {record.tier}", file=sys.stderr)
    print("Store the key now: it cannot be shown again.", file=sys.stderr)
    return EXIT_OK


async def _list(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    _print_table(await store.list(args.account))
    return EXIT_OK


async def _revoke(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    record = await store.revoke(args.key_or_id)
    if record is None:
        # Never echo the argument: it may be a (mistyped) key.
        print("no such key (give a key id like key_0123456789ab, or the whole key)",
              file=sys.stderr)
        return EXIT_FAIL
    print(f"revoked {record.id} (account {record.account})")
    return EXIT_OK


async def _show(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    view = await store.account(args.account)
    if view is None:
        print("no such account", file=sys.stderr)
        return EXIT_FAIL
    active = sum(1 for k in view.keys if k.active)
    balance = await _ledger(store).balance(view.account)
    print(f"account: {view.account}  keys: {len(view.keys)} ({active} active)")
    print(f"credits: available {format_credits(balance.available)}  held "
          f"{format_credits(balance.held)}  spent {format_credits(balance.spent)}")
    await _print_budgets(_ledger(store), view.account)
    _print_table(view.keys)
    return EXIT_OK


async def _print_budgets(ledger: Ledger, account: str) -> None:
    caps, spent, held = await ledger.budgets(account)
    if caps.get("postpaid") == "1":
        print("postpaid: runs on its budgets, no balance check")
    for b in budgets(caps, spent, held, time.time()):
        whose = f"key {b.key_id}" if b.key_id else "account"
        print(f"budget: {whose} per {b.period} {format_credits(b.limit)}  spent "
              f"{format_credits(b.spent)}  held {format_credits(b.held)}  resets "
              f"{utc_text(b.resets_at)}")


async def _credits_budget(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    try:
        micro = parse_credits(args.amount) if args.amount is not None else None
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    ledger = _ledger(store)
    try:
        await ledger.set_budget(args.account, args.period, micro, args.key)
        if args.postpaid is not None:
            await ledger.set_postpaid(args.account, args.postpaid == "on")
    except ValueError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return EXIT_FAIL
    await _print_budgets(ledger, args.account)
    return EXIT_OK


async def _credits_alert_below(args: argparse.Namespace, config: Config, store: KeyStore
                              ) -> int:
    try:
        micro = parse_credits(args.amount) if args.amount is not None else None
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    await _ledger(store).set_alert_below(args.account, micro)
    print(f"{args.account}: " + (f"alerts when the balance falls under {format_credits(micro)}"
                                 if micro is not None else "no balance alert"))
    return EXIT_OK


async def _webhooks_add(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    if urlsplit(args.url).scheme not in ("http", "https") or not urlsplit(args.url).hostname:
        print("the URL must be http(s)://host/...", file=sys.stderr)
        return EXIT_USAGE
    endpoint = await _webhooks(store).add(args.url, args.account)
    print(endpoint.secret)  # all stdout carries: SECRET=$(... webhooks add ...)
    print(f"endpoint {endpoint.id} for {args.account or 'every account'}'s alerts; its signing "
          "secret (printed once) verifies the Igw-Signature header", file=sys.stderr)
    return EXIT_OK


async def _webhooks_list(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    for endpoint in await _webhooks(store).endpoints():
        whose = "every account" if endpoint.account == "*" else endpoint.account
        print(f"{endpoint.id}  {whose}  {_iso(endpoint.created)}  {_public_url(endpoint.url)}")
    return EXIT_OK


async def _webhooks_remove(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    if not await _webhooks(store).remove(args.endpoint_id):
        print("no such endpoint", file=sys.stderr)
        return EXIT_FAIL
    print(f"removed {args.endpoint_id}")
    return EXIT_OK


async def _webhooks_alerts(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    for alert in await _webhooks(store).alerts(args.account, max(1, args.count)):
        body = alert.body
        what = (f"{body['data']['percent']}% of {body['data']['budget']['scope']} "
                f"{body['data']['budget']['period']} budget" if body["type"] ==
                "budget.threshold" else f"balance {body['data']['balance']['credits']}")
        print(f"{body['id']}  {_iso(body['created'])}  {body['type']}  {what}")
        for endpoint_id, attempts in sorted(alert.deliveries.items()):
            print(f"    {endpoint_id}: {attempts.state} after {attempts.attempts} attempt(s)"
                  + (f", last {attempts.last}" if attempts.last else ""))
        if not alert.deliveries:
            print("    due: the sender has not tried it yet" if alert.due
                  else "    not sent: no endpoint was registered for it")
    return EXIT_OK


async def _credits_add(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    from proxy.credits.idempotency import top_up_once
    from proxy.credits.ledger import InsufficientCredits, MadeBefore

    try:
        micro = parse_credits(args.amount)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    try:
        once = top_up_once(args.account, args.idempotency_key, micro, args.reason)
    except GatewayError as exc:
        print(f"--idempotency-key: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    ledger = _ledger(store, ack_replicas=config.gateway.ledger_ack_replicas)
    try:
        available = await ledger.credit(
            args.account, micro, {"reason": args.reason[:200], "actor": "cli",
                                  "ts": int(time.time())}, once=once)
    except InsufficientCredits:
        print("refused: the adjustment would take the balance below zero", file=sys.stderr)
        return EXIT_FAIL
    except MadeBefore as made:
        if (left := made.args[0]) is None:
            print("refused: this idempotency key was used for another top-up", file=sys.stderr)
            return EXIT_FAIL
        print(f"{args.account}: already added under this key ({format_credits(micro)}); "
              f"available then {format_credits(left)} credits")
        return EXIT_OK
    finally:
        await ledger.close()
    print(f"{args.account}: added {format_credits(micro)}, available "
          f"{format_credits(available)} credits")
    return EXIT_OK


async def _credits_reconcile(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    ledger = _ledger(store)
    accounts = [args.account] if args.account else await ledger.accounts()
    problems = await ledger.reconcile(accounts)
    for problem in problems:
        print(f"MISMATCH {problem}")
    print(f"reconcile: {len(accounts)} account(s), {len(problems)} problem(s)")
    return EXIT_FAIL if problems else EXIT_OK


async def _credits_sweep(args: argparse.Namespace, config: Config, store: KeyStore) -> int:
    print(f"released {await _ledger(store).sweep()} expired hold(s)")
    return EXIT_OK


def _ledger(store: KeyStore, ack_replicas: int = 0) -> Ledger:
    from proxy.credits.ledger import Ledger

    return Ledger(store.redis, ack_replicas=ack_replicas)


def _webhooks(store: KeyStore) -> Webhooks:
    from proxy.credits.webhooks import Webhooks

    return Webhooks(store.redis)


_COLUMNS = ("id", "account", "tier", "status", "created", "label")


def _print_table(records: Sequence[KeyRecord]) -> None:
    rows = [[r.id, r.account, r.tier, r.status, _iso(r.created), r.label] for r in records]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(_COLUMNS)]
    for row in [list(_COLUMNS), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _iso(created: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
