"""The embedding servers' vectors: each token has a fixed pseudo-random direction and an input's
vector is the sum of its tokens' (so texts that share words point alike, and cosine
similarity means something when an operator tries retrieval on a simulator), cut to
`dimensions` first and then made unit length, as TEI and vLLM do. Pure: no aiohttp, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from proxy.simulators.textgen import text_tokens

EMBEDDING_SIZE = 384  # a small BERT's (bge-small, all-MiniLM-L6)


def input_tokens(item: str | Sequence[int]) -> list[str]:
    """An input's tokens by the simulators' rule (a token-id list: its ids)."""
    return text_tokens(item) if isinstance(item, str) else [f"#{i}" for i in item]


@lru_cache(maxsize=65536)
def _direction(token: str, size: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def embed(tokens: Sequence[str], size: int, dimensions: int | None = None,
          normalize: bool = True) -> np.ndarray:
    """The float32 vector of `tokens` (`size` long, or its first `dimensions`)."""
    vector = np.zeros(size, dtype=np.float32)
    for token in tokens:
        vector += _direction(token, size)
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(vector))
        if norm > 0:
            vector /= norm
    return vector
