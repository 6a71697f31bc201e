"""Prefix block hashing shared by the engine (prefix cache) and the router (prefix affinity).

A prompt is cut into full blocks of `block_size` token ids; each block's hash chains the previous
block's hash, so equal hashes mean equal whole prefixes (docs/architecture.md, State reports). Partial trailing blocks
are never hashed: they cannot be shared. The chain starts from the LoRA adapter's root hash: K/V computed
under an adapter (which may change the k/v projections) are never reused for the base model or another
adapter, and the router predicts cache hits with the same rule.
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


def root_hash(adapter: str = "") -> int:
    """Where a chain starts: ROOT_HASH for the base model, a hash of the adapter's name otherwise."""
    if not adapter:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8, person=b"lora").digest(), "little")


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, adapter: str = "",
                        upto_blocks: int | None = None) -> list[int]:
    """Append to `hashes` (the chain of the first len(hashes) blocks) the hashes of the next full blocks of
    `token_ids`, up to `upto_blocks` blocks in all; returns `hashes` (extended in place)."""
    full = len(token_ids) // block_size
    upto = full if upto_blocks is None else min(full, upto_blocks)
    prev = hashes[-1] if hashes else root_hash(adapter)
    for i in range(len(hashes), upto):
        prev = hash_block(prev, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(prev)
    return hashes


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, adapter: str = "") -> list[int]:
    """Chain hashes of every full block of `token_ids`, in order, under `adapter` ("" = base model)."""
    return extend_block_hashes([], token_ids, block_size, adapter)


def lora_task_id(adapter: str) -> int:
    """Stable LoRA task id of an adapter name (TensorRT-LLM's LoRA cache key, < 2^63): the same on every
    replica and across restarts, so a task cached by the backend is found again by name."""
    return int.from_bytes(hashlib.sha256(adapter.encode()).digest()[:8], "big") >> 1
