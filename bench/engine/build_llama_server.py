"""Build llama.cpp's `llama-server` once, from the llama-cpp-python source package (which vendors llama.cpp).

Cached under <cache_dir>/llama.cpp/: a second run finds the binary and returns at once. Nothing here is
committed: sources and binaries stay in the cache folder.

    python bench/engine/build_llama_server.py [--jobs 2]
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from common.settings import load_settings


def llama_server_path() -> Path:
    return load_settings().cache_dir / "llama.cpp" / "build" / "bin" / "llama-server"


def build(jobs: int = 2) -> Path:
    binary = llama_server_path()
    if binary.exists():
        return binary
    root = binary.parent.parent.parent
    root.mkdir(parents=True, exist_ok=True)
    sdists = glob.glob(str(root / "llama_cpp_python-*.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python", "-d", str(root)], check=True)
        sdists = glob.glob(str(root / "llama_cpp_python-*.tar.gz"))
    src_root = root / "src"
    if not src_root.exists():
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(src_root, filter="data")
    vendor = next(Path(p) for p in glob.glob(str(src_root / "*" / "vendor" / "llama.cpp")))
    build_dir = root / "build"
    subprocess.run(["cmake", "-S", str(vendor), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"],
                   check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
                   check=True, env={**os.environ})
    if not binary.exists():
        raise FileNotFoundError(f"build finished but {binary} is missing")
    return binary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    args = parser.parse_args()
    print(build(args.jobs))


if __name__ == "__main__":
    main()
