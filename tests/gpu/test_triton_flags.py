"""The GPU replica's tritonserver command line (build_engines.launch) carries Triton's OpenTelemetry trace config
and latency histograms, and a real tritonserver (the vendored 2.51 build the stand-in replicas run) starts with
exactly those flags and reports them back on its trace-settings API."""
from __future__ import annotations

import shlex
import subprocess

import httpx
import pytest

from build_engines.launch import main, plan_launch, trace_rate
from common import processes
from common.settings import load_settings
from common.vendor import triton_env, triton_home

URL = "http://otel-collector.monitoring:4318/v1/traces"


def _flags(cmd: list[str]) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == "--trace-config"]


def test_the_launch_command_carries_trace_config_and_histograms(capsys, monkeypatch) -> None:
    cmd = plan_launch(1, "/repo", trace_url=URL, trace_sample_ratio=0.1)
    assert "--metrics-config=histogram_latencies=true" in cmd
    assert _flags(cmd) == ["mode=opentelemetry", "rate=10", "level=TIMESTAMPS", f"opentelemetry,url={URL}",
                           "opentelemetry,resource=service.name=llm-replica"]
    assert _flags(plan_launch(1, "/repo")) == []                       # no URL: tracing off
    assert _flags(plan_launch(1, "/repo", trace_url=URL, trace_sample_ratio=0)) == []
    ranks = shlex.join(plan_launch(4, "/repo", trace_url=URL)).split(" : ")
    assert "mode=opentelemetry" in ranks[0] and all("--trace-config" not in r for r in ranks[1:])  # rank 0 serves
    assert (trace_rate(1.0), trace_rate(0.25), trace_rate(0.003)) == (1, 4, 333)
    with pytest.raises(ValueError, match="sample ratio"):
        trace_rate(1.5)
    # the pod's container gets both from the llm-fleet-config ConfigMap (envFrom)
    monkeypatch.setenv("FLEET_TRITON_OTLP_URL", URL)
    monkeypatch.setenv("FLEET_TRACE_SAMPLE_RATIO", "0.5")
    assert main(["--model-repo", "/repo", "--print"]) == 0
    printed = shlex.split(capsys.readouterr().out)
    assert "rate=2" in _flags(printed) and f"opentelemetry,url={URL}" in _flags(printed)


def test_tritonserver_starts_with_the_planned_flags(tmp_path) -> None:
    settings = load_settings()
    home = triton_home(settings)
    http, grpc, metrics = processes.free_port(), processes.free_port(), processes.free_port()
    (tmp_path / "repo").mkdir()
    cmd = plan_launch(1, str(tmp_path / "repo"), http, grpc, metrics, str(home / "bin" / "tritonserver"),
                      exit_timeout_s=5, trace_url="http://127.0.0.1:4318/v1/traces", trace_sample_ratio=0.5)
    # what only this machine needs: the vendored backends, loopback addresses
    cmd += [f"--backend-directory={home / 'backends'}", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
            "--metrics-address=127.0.0.1", "--allow-sagemaker=false", "--allow-vertex-ai=false"]
    log = tmp_path / "triton.log"
    proc = subprocess.Popen(cmd, env=triton_env(settings), stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        def settings_api():
            try:
                return httpx.get(f"http://127.0.0.1:{http}/v2/trace/setting", timeout=1).json()
            except httpx.HTTPError:
                return None
        got = processes.wait_until(settings_api, 60, "tritonserver", proc, log)
        assert got["trace_mode"] == "opentelemetry" and got["trace_rate"] == "2", got
        assert got["url"] == "http://127.0.0.1:4318/v1/traces" and got["resource"] == "service.name=llm-replica"
        assert httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
