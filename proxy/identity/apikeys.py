"""API key format, checks and the forms a key is stored and shown in. Pure: no I/O.

A key reads `<prefix>_sk_<random><seal><checksum>`, the GitHub token layout:

    igw_sk_ 4Tq0...(24 base62 chars)...Zk9a  8Hq2Lw0c   01xYzQ
    prefix   random: 24 x log2(62) = 143 bits  seal      checksum: CRC32 of everything before
                                               (8)       it, 6 base62

- The fixed prefix makes a leaked key easy to find with a secret scanner.
- The checksum lets `well_formed` refuse a mistyped key before any Redis lookup: CRC32 catches
  every burst error of up to 32 bits, so every single-character substitution, and the fixed
  length catches every insertion or deletion.
- The seal is an HMAC of the prefix and random part under a secret only the gateway's store
  holds (proxy.identity.keystore): `sealed` tells a key this gateway made from one a scanner
  minted, without a lookup. It decides nothing about access (the store's record does); it only
  lets a key that exists be looked up whatever unknown keys its address has sent. Keys made
  before seals (32 random characters, no seal) still work, as unsealed keys.
- Only `digest(key)` (SHA-256, hex) is ever stored; `key_id(digest)` is the public name used in
  listings, revocation and logs; `redact(key)` is the only form of a key fit for display.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import string
import zlib
from typing import Final

__all__ = [
    "ALPHABET",
    "CHECKSUM_CHARS",
    "RANDOM_BITS",
    "RANDOM_CHARS",
    "SEAL_CHARS",
    "checksum",
    "digest",
    "generate",
    "is_key_id",
    "key_id",
    "key_length",
    "redact",
    "seal",
    "sealed",
    "well_formed",
]

ALPHABET: Final = string.digits + string.ascii_uppercase + string.ascii_lowercase  # base62
RANDOM_CHARS: Final = 32  # the random part and the seal
SEAL_CHARS: Final = 8  # 62**8 ~ 2**47.6: a minted key passes for sealed once in 2e14 tries
RANDOM_BITS: Final = (RANDOM_CHARS - SEAL_CHARS) * math.log2(len(ALPHABET))  # ~142.9, K1: 128
CHECKSUM_CHARS: Final = 6  # 62**6 > 2**32, so any CRC32 fits
SEPARATOR: Final = "_sk_"
KEY_ID_PREFIX: Final = "key_"
KEY_ID_HEX: Final = 12  # 48 bits: short enough to read aloud; the store refuses a collision

_ALPHABET_SET: Final = frozenset(ALPHABET)
_KEY_ID_RE: Final = re.compile(rf"{KEY_ID_PREFIX}[0-9a-f]{{{KEY_ID_HEX}}}")


def key_length(prefix: str) -> int:
    return len(prefix) + len(SEPARATOR) + RANDOM_CHARS + CHECKSUM_CHARS


def checksum(body: str) -> str:
    """CRC32 of `<prefix>_sk_<random><seal>` as 6 base62 characters, most significant first."""
    return _base62(zlib.crc32(body.encode("ascii")), CHECKSUM_CHARS)


def seal(head: str, secret: bytes) -> str:
    """The seal of `<prefix>_sk_<random>`: its HMAC-SHA256 under `secret`, 8 base62."""
    mac = hmac.new(secret, head.encode("ascii"), hashlib.sha256).digest()
    return _base62(int.from_bytes(mac[:8]), SEAL_CHARS)


def generate(prefix: str, secret: bytes) -> str:
    """A new sealed key; `secrets` is the CSPRNG, and `choice` draws each character without
    bias."""
    head = prefix + SEPARATOR + "".join(
        secrets.choice(ALPHABET) for _ in range(RANDOM_CHARS - SEAL_CHARS))
    body = head + seal(head, secret)
    return body + checksum(body)


def sealed(key: str, secret: bytes) -> bool:
    """A well-formed key whose seal is right: made by a store that holds `secret`."""
    head = key[:-CHECKSUM_CHARS - SEAL_CHARS]
    given = key[-CHECKSUM_CHARS - SEAL_CHARS:-CHECKSUM_CHARS]
    return hmac.compare_digest(seal(head, secret), given)


def _base62(value: int, width: int) -> str:
    """The low `width` base62 digits of `value`, most significant first."""
    chars = []
    for _ in range(width):
        value, rem = divmod(value, len(ALPHABET))
        chars.append(ALPHABET[rem])
    return "".join(reversed(chars))


def well_formed(key: str, prefix: str) -> bool:
    """Right prefix, length, alphabet and checksum; says nothing about whether the key exists."""
    head = prefix + SEPARATOR
    if len(key) != key_length(prefix) or not key.startswith(head):
        return False
    tail = key[len(head):]
    if not _ALPHABET_SET.issuperset(tail):
        return False
    body, check = key[:-CHECKSUM_CHARS], key[-CHECKSUM_CHARS:]
    # Not secret, but it is key material: compare in constant time as K1 asks everywhere.
    return hmac.compare_digest(checksum(body), check)


def digest(key: str) -> str:
    """SHA-256 hex of the key: the only form of a key that is ever stored.

    A plain hash (no salt, no slow KDF) is enough: the input has 190 random bits, so there is
    nothing to brute-force, and lookups stay one hash away.
    """
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_id(key_digest: str) -> str:
    """Public id of a key (`key_` + 12 hex of its digest), safe for listings and logs."""
    return KEY_ID_PREFIX + key_digest[:KEY_ID_HEX]


def is_key_id(text: str) -> bool:
    return _KEY_ID_RE.fullmatch(text) is not None


def redact(key: str) -> str:
    """`igw_sk_...a1B2`: enough to recognise a key, too little to use or look it up."""
    cut = key.find(SEPARATOR)
    head = key[: cut + len(SEPARATOR)] if 0 < cut <= 16 else ""
    if len(key) < 20:  # too short to be a key: show nothing of it
        return head + "..."
    return head + "..." + key[-4:]
