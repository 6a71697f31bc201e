"""Fused CPU kernels of the engine's step (csrc/cpu_kernels.cpp): RMSNorm, residual add + RMSNorm, SiLU * up,
RoPE with the new K/V written into the pool, the greedy argmax of the logits; decode attention reading K/V from
the pool's blocks in place (csrc/decode_attention.cpp); and a bf16 linear layer (csrc/cpu_gemm.cpp).

A 32-row step of SmolLM2-135M is ~1,400 small torch ops on a 2-core CPU, and their dispatch and OpenMP
barriers cost as much as the arithmetic; these kernels do the same work in 5 ops per layer besides the GEMMs,
and decode attention no longer copies each row's blocks out of the pool first.

Compiled once per machine with torch's C++ extension builder and ninja (`make install` does it, with this
environment's bin on PATH for the pip `ninja`; a replica only loads the library), for the CPU it runs on (-march=native): the library's name carries a hash of the source, the
flags, torch's version and the CPU's flags, so a changed source or another CPU builds anew instead of loading
stale code or instructions the CPU lacks. Where it cannot be built (no C++ compiler), `load` returns None and
the engine keeps its torch ops (the `cpu_kernels` setting: auto | on | off).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import platform
import time
from pathlib import Path
from types import ModuleType

import torch

from python_backends.engine.device import cpu_flags

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "cpu_kernels.cpp", CSRC / "decode_attention.cpp", CSRC / "cpu_gemm.cpp"]   # the module first
HEADERS = [CSRC / "simd.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]       # libgomp.so.1: the loader reuses the copy torch already loaded (same soname)
SETTINGS = ("auto", "on", "off")
STALE_LOCK_S = 600           # a build lock older than this was left by a killed build (builds take ~30 s)


def _cpu_id() -> str:
    for line in cpu_flags().splitlines():
        if line.startswith("flags"):
            return line
    return platform.processor()


def library_name() -> str:
    texts = [f.read_text() for f in SOURCES + HEADERS]
    digest = hashlib.sha256("\n".join([*texts, " ".join(CFLAGS + LDFLAGS), torch.__version__,
                                       _cpu_id()]).encode()).hexdigest()[:12]
    return f"fleet_cpu_kernels_{digest}"


def build_root() -> Path:
    """Where built libraries live: torch's extension folder (~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR)."""
    from torch.utils.cpp_extension import _get_build_directory
    return Path(_get_build_directory("fleet_cpu_kernels", verbose=False)).parent


def _import(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build(verbose: bool = False) -> ModuleType:
    """Compile (if this source, torch and CPU have no library yet) and import the kernels."""
    from torch.utils.cpp_extension import load as build_extension
    name = library_name()
    directory = build_root() / name
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"      # torch's build lock: a build killed mid-way leaves it, and later ones wait forever
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)
    log.info("building the fused CPU kernels in %s (once per source and machine)", directory)
    return build_extension(name=name, sources=[str(f) for f in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                           build_directory=str(directory), verbose=verbose)


def built_library() -> Path:
    """Where this source's library is once built (it may not exist yet)."""
    name = library_name()
    return build_root() / name / f"{name}.so"


@functools.lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """The kernels, or None where they cannot be built here (logged; callers keep their torch ops).
    A library built before is imported directly: no compiler, ninja or build lock at a replica's start."""
    try:
        built = built_library()  # may fail too: a pod's user whose home (~/.cache) is not writable
        return _import(built.stem, built) if built.exists() else build()
    except Exception as exc:     # no compiler, no ninja, a failed build: the torch ops still work
        log.warning("fused CPU kernels unavailable (%s); the engine uses torch ops", exc)
        return None


def resolve(setting: str, device: torch.device) -> ModuleType | None:
    """The kernels to use for `setting` (auto | on | off) on `device`: never on CUDA; `on` fails loudly where
    they cannot be built, `auto` falls back to torch ops."""
    if setting not in SETTINGS:
        raise ValueError(f"cpu_kernels {setting!r}: allowed are {', '.join(SETTINGS)}")
    if device.type != "cpu" or setting == "off":
        return None
    kernels = load()
    if kernels is None and setting == "on":
        raise ValueError("cpu_kernels 'on' but the fused CPU kernels could not be built here (see the log)")
    return kernels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the engine's fused CPU kernels for this machine "
                                     "(make install runs this; replicas then only load the library).")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's command lines")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = built_library()
    if built.exists():
        print(f"cpu kernels: {built.parent} is up to date")
        return
    build(verbose=args.verbose)
    print(f"cpu kernels: built {built.parent}")


if __name__ == "__main__":
    main()
