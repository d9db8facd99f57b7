"""Who is calling: the principal every policy decision is made for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

PrincipalKind = Literal["key", "jwt", "guest"]
# What an account may be called, by a key's record or a token's claim. No ':', so an account can
# never be mistaken for a guest ("guest:<address>") or split a Redis key or a log line.
ACCOUNT_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$"
GUEST_TIER: Final = "guest"  # the tier of callers without a credential


@dataclass(frozen=True, slots=True)
class Principal:
    kind: PrincipalKind
    account: str  # account id; a guest's is "guest:<client address>"
    tier: str  # a tier name from policies/tiers.toml ("guest", "basic", "pro", "max", ...)
    key_id: str | None = None  # the public id of the API key used (never the key itself)
    role: str = "user"  # "admin" for an admin-role JWT
