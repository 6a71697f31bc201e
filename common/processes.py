"""Local process supervision: start detached services with pid files and logs, wait for health, stop them.

`make up` / `fleet up` start the platform's services through this module and `make down` stops
everything recorded under the run dir, so no process is left behind.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from common.settings import Settings

T = TypeVar("T")


class StartupFailed(RuntimeError):
    pass


def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.3)
        return sock.connect_ex((host, port)) == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """Lowest port the kernel hands out to outgoing connections (and to bind-to-0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(size: int) -> int:
    """First port of `size` free consecutive ports below the ephemeral range: a replica started a minute later
    (autoscaler, actuator) must not find one of its ports taken by some process's outgoing connection, which
    the kernel gives ports from the ephemeral range."""
    top = min(40000, _ephemeral_low()) - size
    for _ in range(200):
        base = random.randrange(15000, top, 10)
        if all(_bindable(base + i) and not port_open("127.0.0.1", base + i) for i in range(size)):
            return base
    raise RuntimeError("no free port block")


def throwaway_platform_env(data_dir: Path) -> dict[str, str]:
    """Environment for a whole local platform (`fleet up`) on its own data dir and a free port block, beside
    any other: tests and the platform benchmark. A caller's KAFKA_BOOTSTRAP_SERVERS is dropped (the
    platform starts its own broker); the autoscaler is off, so the replica count stays what the caller set."""
    base = free_port_block(40)
    env = dict(os.environ)
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    env.update(FLEET_DATA_DIR=str(data_dir), FLEET_ROUTER_HTTP_PORT=str(base), FLEET_ROUTER_GRPC_PORT=str(base + 1),
               FLEET_ADMIN_UI_PORT=str(base + 2), FLEET_KAFKA_PORT=str(base + 3),
               FLEET_ROUTER_INTERNAL_PORT=str(base + 4), FLEET_REPLICA_BASE_PORT=str(base + 10),
               FLEET_AUTOSCALER="off")
    return env


def wait_until(check: Callable[[], T], timeout_s: float, what: str, proc: subprocess.Popen | None = None,
               log_path: Path | None = None, interval_s: float = 0.2) -> T:
    """Poll `check` until it returns something truthy (returned); a check that raises counts as not yet.
    Raises StartupFailed naming `what` when `proc` exits or `timeout_s` passes (the one wait-for-a-condition
    helper of the platform and its tests: nothing waits on a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path and log_path.exists() else ""
            raise StartupFailed(f"{what} exited with code {proc.returncode} while starting.\n{tail}")
        try:
            last = check()
            if last:
                return last
        except Exception as exc:
            last = exc
        time.sleep(interval_s)
    raise StartupFailed(f"{what}: condition not met after {timeout_s:.0f} s (last check: {str(last)[:500]})"
                        + (f"; see {log_path}" if log_path else ""))


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    """Start a process in its own session (so `stop` can kill its whole group), output to log_path."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, cwd=cwd, start_new_session=True)


def record(settings: Settings, name: str, proc: subprocess.Popen, info: dict) -> None:
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    (settings.run_dir / f"{name}.json").write_text(json.dumps({"name": name, "pid": proc.pid, **info}))


def running(settings: Settings) -> list[dict]:
    out = []
    for path in sorted(settings.run_dir.glob("*.json")) if settings.run_dir.exists() else []:
        info = json.loads(path.read_text())
        info["alive"] = pid_alive(info["pid"])
        out.append(info)
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def stop_pid(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL the leader if it outlives the grace period, then SIGKILL whatever
    else is left in the group (a tritonserver can exit before its Python-backend stubs do)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and pid_alive(pid):
            time.sleep(0.1)
        if not pid_alive(pid):
            break
    time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop(settings: Settings, name: str) -> bool:
    path = settings.run_dir / f"{name}.json"
    if not path.exists():
        return False
    stop_pid(json.loads(path.read_text())["pid"])
    path.unlink()
    return True
