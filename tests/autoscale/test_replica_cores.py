"""Replicas and CPU cores: `replica_cpu_cores` auto gives a replica short-spinning OpenMP workers (shared
cores) when another tritonserver already runs on the host, and that reaches tritonserver's environment."""
from __future__ import annotations

import shutil
import subprocess

from common.processes import stop_pid, wait_until
from common.vendor import SHARED_CORES_SPINCOUNT, replica_cores, triton_env


def test_auto_is_shared_while_another_tritonserver_runs(tmp_path):
    fake = tmp_path / "tritonserver"          # a real process whose name is tritonserver's
    shutil.copy(shutil.which("sleep"), fake)
    proc = subprocess.Popen([str(fake), "60"])
    try:
        wait_until(lambda: replica_cores("auto") == "shared", 10, "the other tritonserver seen")
    finally:
        stop_pid(proc.pid)
    assert replica_cores("dedicated") == "dedicated" and replica_cores("shared") == "shared"


def test_shared_cores_set_a_short_openmp_spin_and_one_thread_for_few_rows(settings, monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("FLEET_ENGINE_SMALL_STEP_THREADS", raising=False)
    shared = triton_env(settings, "shared")
    assert shared["GOMP_SPINCOUNT"] == SHARED_CORES_SPINCOUNT and shared["FLEET_ENGINE_SMALL_STEP_THREADS"] == "1"
    dedicated = triton_env(settings, "dedicated")
    assert "GOMP_SPINCOUNT" not in dedicated and "FLEET_ENGINE_SMALL_STEP_THREADS" not in dedicated
    monkeypatch.setenv("FLEET_ENGINE_SMALL_STEP_THREADS", "2")      # an operator's explicit choice stands
    assert triton_env(settings, "shared")["FLEET_ENGINE_SMALL_STEP_THREADS"] == "2"
