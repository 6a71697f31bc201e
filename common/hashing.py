"""Prefix block hashing shared by the engine (prefix cache) and the router (prefix affinity).

A prompt is cut into full blocks of `block_size` token ids; each block's hash chains the previous
block's hash, so equal hashes mean equal whole prefixes (DESIGN.md §4). Partial trailing blocks
are never hashed: they cannot be shared.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(prev_hash: int, block_tokens: Sequence[int]) -> int:
    """Hash of one full block, chained on the previous block's hash (64-bit, stable across processes)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(struct.pack("<Q", prev_hash))
    digest.update(struct.pack(f"<{len(block_tokens)}i", *block_tokens))
    return int.from_bytes(digest.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of every full block of `token_ids`, in order."""
    hashes: list[int] = []
    prev = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash_block(prev, token_ids[start:start + block_size])
        hashes.append(prev)
    return hashes
