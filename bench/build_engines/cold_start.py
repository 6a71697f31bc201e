"""Cold start of a CPU replica (SmolLM2-135M, bf16): from the node-local cache vs from the weights store.

Scenarios, each timed from `tritonserver` spawn (or from the start of the fetch) to /v2/health/ready:
  local_warm     node-local copy, weights in the OS page cache (a restart on the same node)
  local_cold     node-local copy, weights evicted from the page cache (posix_fadvise DONTNEED) first
  store_fs       node-local copy missing: fetch from the weights store on a mounted path + verify, then start
  store_http     node-local copy missing: fetch from the weights store over HTTP (fsspec) + verify, then start
  checkpoint     reference: no conversion cache at all (GGUF -> bf16 conversion), measured once

    python bench/build_engines/cold_start.py --runs 3 [--skip-checkpoint]

Writes bench/results/build_engines_cold_start.json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from build_engines.build import build, ensure_node_local
from build_engines.layout import version_dir  # noqa: E402
from build_engines.plan import parse_options  # noqa: E402
from common.processes import free_port, port_open, stop_pid  # noqa: E402
from common.services import start_triton  # noqa: E402
from common.settings import load_settings  # noqa: E402

MODEL, VERSION = "smollm2-135m", "1"


def evict(root: Path) -> None:
    """Drop root's files from the page cache (clean pages only; no root rights needed)."""
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def start_and_stop(settings, repository: Path, tag: str) -> float:
    base = free_port()
    t = time.perf_counter()
    proc = start_triton(settings, repository, base, settings.logs_dir / f"bench-{tag}-{base}.log")
    ready = time.perf_counter() - t
    stop_pid(proc.pid)
    return ready


def from_store(settings, uri: str, tag: str) -> tuple[float, float]:
    """Remove the node-local copy, then fetch it from `uri` and start; returns (fetch_s, start_s)."""
    shutil.rmtree(version_dir(settings, MODEL, VERSION) / "weights")
    t = time.perf_counter()
    repo = ensure_node_local(settings, MODEL, VERSION, store=uri)
    fetch = time.perf_counter() - t
    return fetch, start_and_stop(settings, repo, tag)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip-checkpoint", action="store_true")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "build_engines_cold_start.json"))
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="cold-start-"))
    os.environ["FLEET_DATA_DIR"] = str(data)
    settings = load_settings()
    res = build(parse_options(model=MODEL, version=VERSION, checkpoint="smollm2", target="cpu"), settings)
    row = res.row or {}
    store = Path(row["weights_uri"])
    repo = Path(row["repository_path"])
    http_port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(http_port), "--bind", "127.0.0.1"],
                              cwd=store.parent.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not port_open("127.0.0.1", http_port):
        time.sleep(0.05)
    http_uri = f"http://127.0.0.1:{http_port}/{MODEL}/{VERSION}"
    results: dict[str, list[dict[str, float]]] = {k: [] for k in ("local_warm", "local_cold", "store_fs",
                                                                  "store_http")}
    try:
        start_and_stop(settings, repo, "warmup")  # first start also lays out the tritonserver run folder
        for i in range(args.runs):
            results["local_warm"].append({"total_s": start_and_stop(settings, repo, f"warm{i}")})
            evict(version_dir(settings, MODEL, VERSION) / "weights")
            results["local_cold"].append({"total_s": start_and_stop(settings, repo, f"cold{i}")})
            for name, uri in (("store_fs", str(store)), ("store_http", http_uri)):
                evict(store)
                fetch, start = from_store(settings, uri, f"{name}{i}")
                results[name].append({"fetch_s": fetch, "start_s": start, "total_s": fetch + start})
    finally:
        stop_pid(server.pid)
    if not args.skip_checkpoint:
        os.environ["FLEET_CACHE_DIR"] = str(data / "empty-cache")
        os.environ["FLEET_DATA_DIR"] = str(data / "fresh")
        fresh = load_settings()
        t = time.perf_counter()
        r = build(parse_options(model=MODEL, version=VERSION, checkpoint="smollm2", target="cpu"), fresh)
        build_s = time.perf_counter() - t
        start = start_and_stop(fresh, Path(r.row["repository_path"]), "checkpoint")
        results["checkpoint"] = [{"build_s": build_s, "start_s": start, "total_s": build_s + start}]
    summary = {k: {m: round(statistics.median(r[m] for r in v), 2) for m in v[0]} for k, v in results.items() if v}
    out = {"model": MODEL, "runs": args.runs, "cpu_count": os.cpu_count(), "summary_median": summary,
           "raw": results, "weights_bytes": sum(f["size"] for f in row["build_info"]["files"].values())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("| scenario | fetch s | start s | total s (median of %d) |\n|---|---|---|---|" % args.runs)
    for k, v in summary.items():
        print(f"| {k} | {v.get('fetch_s', v.get('build_s', '-'))} | {v.get('start_s', v['total_s'])} | {v['total_s']} |")
    shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
