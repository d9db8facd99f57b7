"""The policies in force, replaced whole on reload (SIGHUP or POST /admin/reload), with the
shadow set beside them (policies/shadow/: loaded, replaced or removed by the same reload).

A request reads `LivePolicies.current` once and uses that snapshot throughout, so a reload never
mixes two policy versions inside one request and never drops a connection. A bad file is refused
with its problems listed, and the old policies stay in force.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from limits.aio.storage import MemoryStorage
from limits.aio.strategies import MovingWindowRateLimiter

from proxy.config import Config, ConfigError, Policies, ShadowPolicies, load_config
from proxy.credits.token_windows import WindowsByTier
from proxy.identity.auth import Authenticator
from proxy.identity.keystore import KeyStore
from proxy.store.client import Store

log = logging.getLogger("proxy.policy.live")

# Every worker of every gateway follows this channel: a reload asked of one (POST /admin/reload)
# reaches them all. The message is the asking process's origin id, so it does not reload twice.
RELOADS = "igw:policies:reload"


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    policies: Policies
    auth: Authenticator
    version: int
    token_windows: WindowsByTier = field(default_factory=WindowsByTier)
    shadow: ShadowPolicies | None = None  # policies/shadow/: judged beside, never enforced


class LivePolicies:
    def __init__(self, config: Config, keystore: KeyStore) -> None:
        self._root = Path(config.root)
        self._keystore = keystore
        self.origin = uuid.uuid4().hex
        # Per-address budget of key lookups that reach Redis; kept across reloads.
        self._key_lookups = MovingWindowRateLimiter(MemoryStorage())
        self.current = self._snapshot(config.policies, config.shadow, version=1)

    def _snapshot(self, policies: Policies, shadow: ShadowPolicies | None, version: int
                  ) -> PolicySnapshot:
        jwt = None
        if policies.auth.jwt.algorithms:
            from proxy.identity.jwt import JwtVerifier  # PyJWT only where JWTs are configured

            jwt = JwtVerifier(policies.auth.jwt, self._root)
        auth = Authenticator(policies.auth, self._keystore, jwt, self._key_lookups)
        return PolicySnapshot(policies, auth, version, shadow=shadow)

    def on_notice(self, origin: str) -> None:
        if origin != self.origin:
            self.reload()

    async def announce(self, redis: Store) -> None:
        """Tell every other worker and gateway to reload too."""
        await redis.publish(RELOADS, self.origin)

    def reload(self) -> list[str]:
        """Load policies/ again; on any problem keep the old ones and return the problems."""
        try:
            config = load_config(self._root)
            snapshot = self._snapshot(config.policies, config.shadow, self.current.version + 1)
        except ConfigError as exc:
            log.warning("policy reload refused: %s", "; ".join(exc.problems))
            return exc.problems
        except ValueError as exc:  # key material the JWT verifier cannot use
            log.warning("policy reload refused: %s", exc)
            return [f"policies/auth.toml: jwt: {exc}"]
        self.current = snapshot
        log.info("policies reloaded (version %d%s)", snapshot.version,
                 f", shadow {', '.join(snapshot.shadow.files)}" if snapshot.shadow else "")
        return []
