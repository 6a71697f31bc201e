"""The GPU replica's tritonserver command line (build_engines.launch) carries Triton's OpenTelemetry trace config
and latency histograms, and a real tritonserver (the vendored 2.51 build the stand-in replicas run) started with
exactly those flags continues a caller's trace from gRPC metadata and exports its spans over OTLP/HTTP."""
from __future__ import annotations

import http.server
import json
import shlex
import subprocess
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

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


class _OtlpHttp(http.server.BaseHTTPRequestHandler):
    """OTLP/HTTP JSON receiver (what Triton's C++ exporter sends): keeps (trace id, parent id, span id, name)."""
    spans: list[tuple[str, str, str, str]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        for rs in body.get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                self.spans += [(sp["traceId"], sp.get("parentSpanId", ""), sp["spanId"], sp["name"])
                               for sp in ss.get("spans", [])]
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _echo_repository(repo: Path) -> Path:
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(
        'name: "echo"\nbackend: "python"\nmax_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
        'input [{ name: "x" data_type: TYPE_INT32 dims: [ -1 ] }]\n'
        'output [{ name: "y" data_type: TYPE_INT32 dims: [ -1 ] }]\ninstance_group [{ count: 1 kind: KIND_CPU }]\n')
    (repo / "echo" / "1" / "model.py").write_text(
        "import triton_python_backend_utils as pb_utils\n"
        "class TritonPythonModel:\n"
        "    def execute(self, requests):\n"
        "        for r in requests:\n"
        "            x = pb_utils.get_input_tensor_by_name(r, 'x').as_numpy()\n"
        "            r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor('y', x)]),\n"
        "                                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)\n")
    return repo


def test_tritonserver_with_the_planned_flags_continues_the_callers_trace(tmp_path) -> None:
    """The vendored tritonserver, started with the launch plan's flags, echoes them on its trace-settings API and
    exports, to a real OTLP/HTTP endpoint, spans of a streamed request under the `traceparent` the router sends
    as gRPC metadata (router_service/upstream.py)."""
    _OtlpHttp.spans = []
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtlpHttp)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    settings = load_settings()
    home = triton_home(settings)
    http_port, grpc_port, metrics_port = processes.free_port(), processes.free_port(), processes.free_port()
    cmd = plan_launch(1, str(_echo_repository(tmp_path / "repo")), http_port, grpc_port, metrics_port,
                      str(home / "bin" / "tritonserver"), exit_timeout_s=5, trace_url=url, trace_sample_ratio=1.0)
    # what only this machine needs: the vendored backends, loopback addresses, a short export delay
    cmd += [f"--backend-directory={home / 'backends'}", "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
            "--metrics-address=127.0.0.1", "--trace-config", "opentelemetry,bsp_schedule_delay=200"]
    log = tmp_path / "triton.log"
    proc = subprocess.Popen(cmd, env=triton_env(settings), stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{http_port}"
        processes.wait_until(lambda: httpx.get(f"{base}/v2/models/echo/ready", timeout=1).status_code == 200,
                             90, "tritonserver", proc, log)
        got = httpx.get(f"{base}/v2/trace/setting", timeout=5).json()
        assert got["trace_mode"] == "opentelemetry" and got["trace_rate"] == "1" and got["url"] == url
        assert got["resource"] == "service.name=llm-replica"
        trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        done: list = []
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        client.start_stream(lambda result, error: done.append(error or result),
                            headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        x = grpcclient.InferInput("x", [3], "INT32")
        x.set_data_from_numpy(np.array([1, 2, 3], dtype=np.int32))
        client.async_stream_infer("echo", [x])
        processes.wait_until(lambda: done, 30, "the streamed response")
        client.stop_stream()
        def arrived():  # exported in batches: wait for the request's span and the model's, whichever comes last
            spans = [s for s in _OtlpHttp.spans if s[0] == trace_id]
            return spans if {s[3] for s in spans} >= {"InferRequest", "echo"} else None
        spans = processes.wait_until(arrived, 30, "Triton's InferRequest and echo spans at the OTLP endpoint")
        request = next(s for s in spans if s[3] == "InferRequest")
        assert request[1] == parent    # Triton's request span is a child of the caller's span
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        receiver.shutdown()
