"""API key format, checks and the forms a key is stored and shown in. Pure: no I/O.

A key reads `<prefix>_sk_<random><checksum>`, the GitHub token layout:

    igw_sk_ 4Tq0...(32 base62 chars)...Zk9a 01xYzQ
    prefix   random: 32 x log2(62) = 190 bits   checksum: CRC32 of everything before it, 6 base62

- The fixed prefix makes a leaked key easy to find with a secret scanner.
- The checksum lets `well_formed` refuse a mistyped key before any Redis lookup: CRC32 catches
  every burst error of up to 32 bits, so every single-character substitution, and the fixed
  length catches every insertion or deletion.
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
    "checksum",
    "digest",
    "generate",
    "is_key_id",
    "key_id",
    "key_length",
    "redact",
    "well_formed",
]

ALPHABET: Final = string.digits + string.ascii_uppercase + string.ascii_lowercase  # base62
RANDOM_CHARS: Final = 32
RANDOM_BITS: Final = RANDOM_CHARS * math.log2(len(ALPHABET))  # ~190.5, K1 asks for >= 128
CHECKSUM_CHARS: Final = 6  # 62**6 > 2**32, so any CRC32 fits
SEPARATOR: Final = "_sk_"
KEY_ID_PREFIX: Final = "key_"
KEY_ID_HEX: Final = 12  # 48 bits: short enough to read aloud; the store refuses a collision

_ALPHABET_SET: Final = frozenset(ALPHABET)
_KEY_ID_RE: Final = re.compile(rf"{KEY_ID_PREFIX}[0-9a-f]{{{KEY_ID_HEX}}}")


def key_length(prefix: str) -> int:
    return len(prefix) + len(SEPARATOR) + RANDOM_CHARS + CHECKSUM_CHARS


def checksum(body: str) -> str:
    """CRC32 of `<prefix>_sk_<random>` as 6 base62 characters, most significant first."""
    value = zlib.crc32(body.encode("ascii"))
    chars = []
    for _ in range(CHECKSUM_CHARS):
        value, rem = divmod(value, len(ALPHABET))
        chars.append(ALPHABET[rem])
    return "".join(reversed(chars))


def generate(prefix: str) -> str:
    """A new key; `secrets` is the CSPRNG, and `choice` draws each character without bias."""
    body = prefix + SEPARATOR + "".join(secrets.choice(ALPHABET) for _ in range(RANDOM_CHARS))
    return body + checksum(body)


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
