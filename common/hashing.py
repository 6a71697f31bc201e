"""Prefix block hashing shared by the engine (prefix cache) and the router (prefix affinity).

A prompt is cut into full blocks of `block_size` token ids; each block's hash chains the previous
block's hash, so equal hashes mean equal whole prefixes (docs/architecture.md, State reports). Partial trailing blocks
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


def lora_task_id(adapter: str) -> int:
    """Stable LoRA task id of an adapter name (TensorRT-LLM's LoRA cache key, < 2^63): the same on every
    replica and across restarts, so a task cached by the backend is found again by name."""
    return int.from_bytes(hashlib.sha256(adapter.encode()).digest()[:8], "big") >> 1
