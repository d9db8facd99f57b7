"""Who is calling: the principal every policy decision is made for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PrincipalKind = Literal["key", "jwt", "guest"]


@dataclass(frozen=True, slots=True)
class Principal:
    kind: PrincipalKind
    account: str  # account id; a guest's is "guest:<client address>"
    tier: str  # a tier name from policies/tiers.toml ("guest", "basic", "pro", "max", ...)
    key_id: str | None = None  # the public id of the API key used (never the key itself)
    role: str = "user"  # "admin" for an admin-role JWT
