"""Fixtures for the reliability tests: a tiny real filesystem (tmpfs) for disk-full faults, and the router
stack the router-fault and chaos tests share."""
from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.router_stack import RouterStack
from tests.usage.conftest import make_event, topic  # noqa: F401 (shared fixtures)

INTER_TOKEN_S = 3.0   # a stalled stream is noticed within seconds


def start_fault_stack(data_dir: Path, router_args: tuple[str, ...] = ("--no-usage",),
                      replica_env: dict[str, str] | None = None, **router_env: str) -> RouterStack:
    """Three fp32 replicas (the same text wherever a stream resumes) behind a router whose inter-token timeout
    is INTER_TOKEN_S, plus the caller's router (and replica) settings."""
    return RouterStack.start(data_dir, replicas=3, engine_env={"FLEET_ENGINE_DTYPE": "fp32", **(replica_env or {})},
                             router_args=router_args,
                             router_env={"FLEET_ROUTER_INTER_TOKEN_TIMEOUT_S": str(INTER_TOKEN_S), **router_env})


def mount_tmpfs(path: Path, size: str) -> subprocess.CompletedProcess:
    """Mount a tmpfs of `size` (e.g. "3m") at path; returncode != 0 where mount is refused (no root)."""
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs mounted for the test (needs root / CAP_SYS_ADMIN; skipped where mount is refused)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = mount_tmpfs(mnt, "3m")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
