"""Stage one model version into this node's cache (the pool pod's init container).

    python -m build_engines.node_local --model llama-70b --version 1 --cache-max-gb 1500

Fills `<data dir>/engines/<model>/<version>` from the weights store (sha256 of every file checked against the
store's manifest) and prints the Triton repository path. The cache outlives one pod (in Kubernetes a
node-local volume, see docs/kubernetes.md), so:
- a copy found in the cache is re-verified file by file against its manifest before it is reused (a disk
  error or a half-written file is not served); a copy that fails is removed and fetched again;
- after staging, other versions are evicted, least recently used first, until the cache fits
  `--cache-max-gb` (the version being staged is never evicted). Every use touches `.last-used`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from build_engines import stage
from build_engines.build import ensure_node_local
from build_engines.layout import version_dir
from build_engines.plan import BuildError
from common.settings import load_settings

LAST_USED = ".last-used"


def reverify_cached(vdir: Path) -> bool:
    """Check a cached copy against its manifest; remove it when it does not match. True when it was kept."""
    for root in (vdir, vdir / "weights"):  # GPU engines are staged whole, CPU weights under weights/
        manifest_file = root / stage.MANIFEST
        if not manifest_file.is_file():
            continue
        want = json.loads(manifest_file.read_text())
        got = {k: v for k, v in stage.manifest_of(root, f"re-verify {root}").items() if k != stage.MANIFEST}
        if got == want:
            return True
        bad = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))[:5]
        print(f"cached copy at {root} does not match its manifest ({bad}); fetching it again", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
        return False
    return False


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _last_used(vdir: Path) -> float:
    marker = vdir / LAST_USED
    return marker.stat().st_mtime if marker.exists() else vdir.stat().st_mtime


def evict_by_size(engines_dir: Path, keep: Path, max_bytes: int) -> list[Path]:
    """Remove cached versions other than `keep`, least recently used first, until the cache fits max_bytes."""
    versions = [v for m in engines_dir.iterdir() if m.is_dir() for v in m.iterdir() if v.is_dir()] \
        if engines_dir.is_dir() else []
    sizes = {v: _size(v) for v in versions}
    total, evicted = sum(sizes.values()), []
    for vdir in sorted((v for v in versions if v.resolve() != keep.resolve()), key=_last_used):
        if total <= max_bytes:
            break
        shutil.rmtree(vdir, ignore_errors=True)
        total -= sizes[vdir]
        evicted.append(vdir)
        print(f"evicted {vdir} ({sizes[vdir] / 1e9:.1f} GB) from the node cache", file=sys.stderr)
    return evicted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m build_engines.node_local", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--store", default=None, help="read the staged copy through this URL instead of weights_uri")
    ap.add_argument("--cache-max-gb", type=float, default=None,
                    help="evict other cached versions (least recently used first) until the cache fits this size")
    args = ap.parse_args(argv)
    if args.cache_max_gb is not None and args.cache_max_gb <= 0:
        ap.error(f"--cache-max-gb {args.cache_max_gb}: must be a positive number of gigabytes")
    settings = load_settings()
    try:
        vdir = version_dir(settings, args.model, args.version)
        reverify_cached(vdir)
        repo = ensure_node_local(settings, args.model, args.version, store=args.store)
        (vdir / LAST_USED).touch()
        if args.cache_max_gb is not None:
            evict_by_size(settings.engines_dir, vdir, int(args.cache_max_gb * 1e9))
    except (BuildError, ValueError, OSError) as exc:
        print(f"cannot stage {args.model} version {args.version}: {exc}", file=sys.stderr)
        return 2
    print(repo)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
