"""A shadow policy's request rate and token windows (proxy.policy.shadow), counted in Redis in
keys of their own beside the live ones (credits/lua/shadow.lua): one script call per judged
request, sent in batches (one write per primary for every request judged in the last few
milliseconds), after the requests have ended, off their path.

A keyed caller's windows live beside its live ones (the account's hash tag); a guest's on the
counters' Redis, as its live window does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

from proxy import ids
from proxy.config import TierPolicy
from proxy.credits.admission import WINDOW_MS
from proxy.credits.ledger import AccountKeys, Ledger, lua_script
from proxy.credits.token_windows import BUCKETS, TokenWindow
from proxy.identity.principal import Principal
from proxy.store.client import Primaries, Store
from proxy.store.script_pipe import ScriptPipes

# What the windows said of one request: within the request rate, and the token window it did
# not fit in; None when the store could not be asked.
Counted = tuple[bool, TokenWindow | None] | None


@dataclass(frozen=True, slots=True)
class Ask:
    """One request to count: `check_tokens` False for one the shadow refused before its
    limits (counted in the request window only, as the gateway counts refused attempts)."""

    principal: Principal
    tier_name: str
    tier: TierPolicy
    windows: tuple[TokenWindow, ...]
    prompt: int
    completion: int
    check_tokens: bool


class ShadowWindows:
    def __init__(self, ledger: Ledger, counters: Store) -> None:
        source = lua_script("shadow")
        self._keyed_script = ledger.redis.register_script(source)
        self._guest_script = counters.register_script(source)
        self._keyed = ScriptPipes(ledger.primaries)
        self._own_counters = counters is not ledger.redis
        self._counters = Primaries(counters) if self._own_counters else ledger.primaries
        self._guests = ScriptPipes(self._counters)
        # Each caller's key names (account, tier, windows -> names), made once.
        self._names: dict[tuple[str, str, tuple[TokenWindow, ...]], list[str]] = {}
        self._stores = {False: (self._keyed, ledger.primaries, self._keyed_script),
                        True: (self._guests, self._counters, self._guest_script)}

    async def count(self, asks: Sequence[Ask]) -> list[Counted]:
        """Count each request in its windows; one write per primary for them all."""
        groups: dict[tuple[bool, int], list[int]] = {}
        commands: dict[int, tuple[Any, ...]] = {}
        clients: dict[tuple[bool, int], Any] = {}
        answers: list[Counted] = [None] * len(asks)
        for i, ask in enumerate(asks):
            keys = self._names.get((ask.principal.account, ask.tier_name, ask.windows))
            if keys is None:
                if len(self._names) > 100_000:
                    self._names.clear()
                keys = self._names[ask.principal.account, ask.tier_name, ask.windows] = \
                    _key_names(ask)
            guest = ask.principal.kind == "guest"
            _, primaries, script = self._stores[guest]
            try:
                client = primaries.client_for(keys[0])
            except RedisError:  # the slot map not read yet, or mid-failover: read it again
                await primaries.refresh()
                try:
                    client = primaries.client_for(keys[0])
                except RedisError:
                    continue  # this one goes uncounted
            group = (guest, id(client))
            clients[group] = client
            groups.setdefault(group, []).append(i)
            commands[i] = (b"EVALSHA", script.sha, *_command(ask, keys))
        for group, members in groups.items():
            pipes, _, script = self._stores[group[0]]
            try:
                replies = await _run(pipes, clients[group], script,
                                     [commands[i] for i in members])
            except RedisError:
                continue
            for i, reply in zip(members, replies, strict=True):
                refusing = int(reply[1])
                answers[i] = (int(reply[0]) == 1,
                              asks[i].windows[refusing - 1] if refusing else None)
        return answers

    async def close(self) -> None:
        await self._keyed.close()
        await self._guests.close()
        if self._own_counters:
            await self._counters.close()


def _command(ask: Ask, keys: list[str]) -> tuple[Any, ...]:
    """The script call's keys and arguments for `ask`, its key names given."""
    args: list[object] = [ask.tier.requests_per_minute, WINDOW_MS, ids.hex_id(),
                          "1" if ask.check_tokens else "0"]
    if not ask.check_tokens:
        return 1, keys[0], *args  # the request window alone
    for w in ask.windows:
        args += (*BUCKETS[w.period], w.limit, w.reserve(ask.prompt, ask.completion))
    return len(keys), *keys, *args


def _key_names(ask: Ask) -> list[str]:
    """The request window's key, then each token window's."""
    keys = AccountKeys.of(ask.principal.account)
    return [keys.shadow_window(ask.tier_name),
            *(keys.shadow_tokens(ask.tier_name, w.suffix) for w in ask.windows)]


async def _run(pipes: ScriptPipes, client: Any, script: AsyncScript,
               commands: list[tuple[Any, ...]]) -> list[Any]:
    pipe = pipes.pipe(client)
    try:
        return await pipe.pipeline(commands)
    except NoScriptError:  # Redis restarted and lost its script cache: load, then again
        await client.script_load(script.script)
        return await pipe.pipeline(commands)
