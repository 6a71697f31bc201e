"""The GPU state sidecar's report fan-out (a headless Service name -> every router) and the drain marker that
keeps its report loop saying `draining` while the preStop hook (another process) drains."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from python_backends import trtllm_state


def test_a_name_with_several_addresses_becomes_one_url_per_address(monkeypatch) -> None:
    import socket

    def cluster_dns(host, port, type=0):  # no cluster DNS here: its answer for a headless Service, two routers
        assert host == "llm-router-internal"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("10.0.0.7", "10.0.1.9")]

    monkeypatch.setattr(socket, "getaddrinfo", cluster_dns)
    assert trtllm_state.expand_routers(["http://llm-router-internal:8032", "http://127.0.0.1:9"]) == [
        "http://10.0.0.7:8032", "http://10.0.1.9:8032", "http://127.0.0.1:9"]


class _ReplicaAndRouter:
    """Real HTTP on one port: a metrics endpoint answering like Triton's (`active` requests) and a router's
    internal listener recording each report's `draining`."""

    def __init__(self, active: int) -> None:
        import json

        reports: list[bool] = []
        self.reports = reports

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = f'nv_trt_llm_request_metrics{{model="tensorrt_llm",request_type="active"}} {active}\n'.encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                reports.append(json.loads(self.rfile.read(int(self.headers["content-length"])))["draining"])
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


def test_the_report_loop_says_draining_once_the_prestop_hook_runs(tmp_path, monkeypatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    both = _ReplicaAndRouter(active=1)
    identity = {"replica_id": "llm-pool-x-1-abc", "routers": [both.url], "report_key": "k"}
    loop = threading.Thread(target=trtllm_state.run, args=(f"{both.url}/metrics", 0.05, identity, 1.5), daemon=True)
    loop.start()
    time.sleep(0.5)
    trtllm_state.drain_marker("llm-pool-x-1-abc").touch()  # what `drain` does in the other process
    loop.join(5)
    both.httpd.shutdown()
    reports = both.reports
    assert reports and reports[0] is False and reports[-1] is True
    assert reports.index(True) == len(reports) - reports[::-1].index(False)  # never back to not draining


def test_a_drain_that_finds_the_replica_idle_still_tells_the_routers_and_stays_drained(tmp_path, monkeypatch) -> None:
    """The CI failure this guards: an idle replica's drain returned before its sender thread ran (the one
    `draining` report was dropped) and removed its marker, so the engine's own reports said `serving` again."""
    import tempfile

    from python_backends.engine.state_report import clear_stale_drain

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    both = _ReplicaAndRouter(active=0)
    identity = {"replica_id": "llm-pool-x-1-idle", "routers": [both.url], "report_key": "k"}
    assert trtllm_state.drain(f"{both.url}/metrics", identity, None, timeout_s=5, poll_s=0.05)
    both.httpd.shutdown()
    assert both.reports == [True]  # sent before drain returned, not lost with the sender thread
    marker = trtllm_state.drain_marker("llm-pool-x-1-idle")
    assert marker.exists()  # the pod is terminating: every later report of the replica says draining
    clear_stale_drain("llm-pool-x-1-idle")  # a replica of that id starting again
    assert not marker.exists()
