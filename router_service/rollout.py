"""Version choice for a request: the registry's percent split, sticky per caller/session."""
from __future__ import annotations

import hashlib


def pick_version(split: dict[str, int], sticky_key: str) -> str:
    """Deterministic: the same key lands on the same version while the split stays the same, and a
    percent change moves only the keys whose bucket crosses a boundary."""
    if not split:
        raise ValueError("empty split")
    bucket = int.from_bytes(hashlib.sha256(sticky_key.encode()).digest()[:8], "big") % 10_000
    edge = 0
    for version in sorted(split):
        edge += split[version] * 100
        if bucket < edge:
            return version
    return sorted(split)[-1]
