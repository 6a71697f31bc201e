"""The running platform shared by the integration tests: one `fleet up` per test session (it costs ~40 s),
and `fleet down` at the end, which must leave no process behind."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.processes import StartupFailed, pid_alive, wait_until
from tests.integration.platform import Platform, platform_env


@pytest.fixture(scope="session")
def platform(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("platform")
    p = Platform(platform_env(data_dir), data_dir)
    up = p.fleet("up")
    assert up.returncode == 0, f"fleet up failed:\n{up.stdout}\n{up.stderr}"
    assert "API key" in up.stdout and p.api_key in up.stdout
    pids = [json.loads(f.read_text())["pid"] for f in (data_dir / "run").glob("*.json")]
    assert len(pids) >= 5, "expected broker, loader, replica, router and UI processes"
    p.wait_serving()
    yield p
    down = p.fleet("down")
    assert down.returncode == 0, down.stderr
    try:  # `fleet down` waits for each leader; a stub may need a moment to be reaped
        wait_until(lambda: not [pid for pid in pids if pid_alive(pid)] and not _group_members(set(pids)), 15,
                   "platform processes gone")
    except StartupFailed:
        pass
    assert not [pid for pid in pids if pid_alive(pid)], "fleet down left processes behind"
    assert not _group_members(set(pids)), "fleet down left child processes (e.g. backend stubs) behind"


def _group_members(groups: set[int]) -> list[int]:
    """Live processes whose process group is one that `fleet up` started."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            out.append(int(stat.parent.name))
    return out


