"""Stage one model version onto this node's local disk (the init step of a replica pod).

Downloads the version's artefacts from the weights store into the node-local cache when they are missing,
verifies every file's sha256 against the store's manifest, and prints the Triton repository path. Exits 2 when
the version is not staged or a checksum does not match (the pod then never starts serving bad weights).

    python -m build_engines.node_local --model llama-70b --version 1
"""
from __future__ import annotations

import argparse
import sys

from build_engines.build import ensure_node_local
from build_engines.plan import BuildError
from common.settings import load_settings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m build_engines.node_local", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--store", default=None, help="read the staged copy through this URL instead of weights_uri")
    args = ap.parse_args(argv)
    settings = load_settings()
    try:
        repo = ensure_node_local(settings, args.model, args.version, store=args.store)
    except (BuildError, ValueError, OSError) as exc:
        print(f"cannot stage {args.model} version {args.version}: {exc}", file=sys.stderr)
        return 2
    print(repo)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
