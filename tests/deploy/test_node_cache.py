"""The node cache the pool pods' init container fills: a reused copy is re-verified, the cache is evicted by size."""
from __future__ import annotations

import json
import os
from pathlib import Path

from build_engines import stage
from build_engines.node_local import LAST_USED, evict_by_size, reverify_cached


def _cached_version(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / stage.MANIFEST).write_text(json.dumps(stage.manifest_of(root)))
    return root


def test_a_cached_copy_is_reused_only_while_it_matches_its_manifest(tmp_path) -> None:
    vdir = _cached_version(tmp_path / "engines" / "m" / "1", {"rank0.engine": b"e" * 4096, "config.json": b"{}"})
    assert reverify_cached(vdir) is True and (vdir / "rank0.engine").exists()
    (vdir / "rank0.engine").write_bytes(b"e" * 4095 + b"x")  # one flipped byte on the node's disk
    assert reverify_cached(vdir) is False
    assert not vdir.exists()  # removed: the init container fetches it again from the store


def test_eviction_removes_least_recently_used_versions_until_the_cache_fits(tmp_path) -> None:
    engines = tmp_path / "engines"
    old = _cached_version(engines / "a" / "1", {"w": b"0" * 3000})
    mid = _cached_version(engines / "b" / "1", {"w": b"0" * 3000})
    new = _cached_version(engines / "c" / "2", {"w": b"0" * 3000})
    for age, vdir in ((300, old), (200, mid), (0, new)):
        (vdir / LAST_USED).touch()
        os.utime(vdir / LAST_USED, (os.path.getmtime(vdir / LAST_USED) - age,) * 2)
    evicted = evict_by_size(engines, keep=old, max_bytes=7000)  # the one being staged is kept even if oldest
    assert evicted == [mid] and old.exists() and new.exists()
    assert evict_by_size(engines, keep=old, max_bytes=100_000) == []
