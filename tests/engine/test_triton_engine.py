"""The engine served by a real tritonserver as the decoupled Python-backend model `engine`
(docs/architecture.md, Replica interface):
streamed greedy ids equal transformers', every response carries every output, the final one carries
finish_reason + usage with the FINAL flag, cancellation frees the blocks, custom metrics are on the metrics
port, and state reports reach a router endpoint."""
from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from common.hashing import prefix_block_hashes
from common.processes import free_port, stop_pid, wait_until
from python_backends.engine.config import EngineConfig
from tests.engine.conftest import ADAPTERS_DIR, CHAT

pytestmark = pytest.mark.integration


class _Collector(BaseHTTPRequestHandler):
    reports: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path == "/internal/replica-state":
            _Collector.reports.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def router_stub():
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def triton(settings, smollm2_dir, router_stub, tmp_path_factory):
    from build_engines.triton_repo import CPU_STEPS, render_repository, cpu_values
    from common.services import start_triton

    out = tmp_path_factory.mktemp("engine-repo")
    steps = tuple(s for s in CPU_STEPS if (Path("model_repository") / s / "1" / "model.py").exists() or s == "llm")
    repo = render_repository(out / "repo", cpu_values(smollm2_dir, ADAPTERS_DIR, 2048), steps=steps)
    base = free_port()
    env = {"FLEET_ENGINE_DTYPE": "fp32", "FLEET_ENGINE_NUM_KV_BLOCKS": "512", "FLEET_ROUTER_URLS": router_stub,
           "FLEET_REPLICA_ID": "test-replica", "FLEET_MODEL": "smollm2-135m", "FLEET_VERSION": "1",
           "FLEET_ENGINE_WARMUP_SEQS": str(EngineConfig.warmup_seqs)}  # the production default (conftest: 2)
    proc = start_triton(settings, repo, base, out / "triton.log", extra_env=env)
    yield {"grpc": f"127.0.0.1:{base + 1}", "metrics": f"http://127.0.0.1:{base + 2}/metrics", "steps": steps,
           "log": out / "triton.log"}
    stop_pid(proc.pid)


def _inputs(ids, max_tokens):
    import tritonclient.grpc as grpcclient

    a = grpcclient.InferInput("input_ids", [len(ids)], "INT32")
    a.set_data_from_numpy(np.asarray(ids, dtype=np.int32))
    b = grpcclient.InferInput("max_tokens", [1], "INT32")
    b.set_data_from_numpy(np.asarray([max_tokens], dtype=np.int32))
    return [a, b]


def _stream(url, model, inputs, params=None, cancel_after=None):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer(model, inputs, request_id="t", parameters=params or {})
    responses = []
    try:
        while True:
            result, error = q.get(timeout=120)
            assert error is None, error
            responses.append(result)
            if cancel_after is not None and len(responses) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return responses
            if result.as_numpy("finish_reason").reshape(-1)[0]:
                return responses
    finally:
        client.stop_stream()
        client.close()


def _metrics(url) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("fleet_engine_") and "{" in line:
            values[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return values


def test_the_model_is_ready_only_after_the_engine_warm_up_ran(triton):
    """Warm before ready (python_backends/engine/warmup.py): the fixture waited for Triton's readiness; by then
    the warm-up burst had finished, before Triton loaded the model (initialize returned)."""
    log = triton["log"].read_text()
    warmed = re.search(r"warm-up done: (\d+) sequences", log)
    assert warmed and int(warmed.group(1)) == EngineConfig.warmup_seqs, log[-2000:]
    loaded = log.find("successfully loaded 'engine'")
    assert 0 <= warmed.start() < loaded, "the model was ready before its warm-up"
    def nothing_left_over() -> bool:  # the gauges are published on the replica's tick, not at once
        m = _metrics(triton["metrics"])
        return m.get("fleet_engine_running") == 0 and m.get("fleet_engine_kv_blocks_used") == 0
    wait_until(nothing_left_over, 10, "the warm-up's sequences and KV blocks released")


def _burst(url: str, seed: int, streams: int = 8, new_tokens: int = 16) -> tuple[float, float]:
    """`streams` concurrent streams of distinct random prompts (no prefix-cache hits between bursts):
    (wall seconds for the whole burst, the slowest time to first token)."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(300, 40000) for _ in range(48)] for _ in range(streams)]
    ttft: list[float] = []
    start = time.monotonic()

    def one(prompt: list[int]) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(url)
        first: queue.Queue = queue.Queue()
        done = threading.Event()

        def callback(result, error) -> None:
            if error is not None or result.as_numpy("finish_reason").reshape(-1)[0]:
                done.set()
            first.put(time.monotonic())
        client.start_stream(callback=callback)
        client.async_stream_infer("engine", _inputs(prompt, new_tokens), request_id=f"b{seed}")
        ttft.append(first.get(timeout=120) - start)
        done.wait(120)
        client.stop_stream()
        client.close()
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ttft) == streams
    return time.monotonic() - start, max(ttft)


def test_the_first_burst_on_a_fresh_replica_is_as_fast_as_the_second(triton):
    """Warm before ready, as a caller sees it: this module's replica has served nothing but its warm-up, and its
    first 8-stream burst is not much slower than the next one (distinct prompts). Without a warm-up a 2-core EPYC
    measured 3.8x the second burst's TTFT p95; the bound here (2x + 1 s) only catches that kind of regression, as
    timings on a shared CI machine are noisy; the measured ratios are `python -m bench.engine.first_burst`'s
    (docs/benchmarks.md). Must run before any other test sends this replica work (pytest keeps file order)."""
    first_s, first_ttft = _burst(triton["grpc"], seed=1)
    second_s, second_ttft = _burst(triton["grpc"], seed=2)
    assert first_s <= 2 * second_s + 1.0, (first_s, second_s)
    assert first_ttft <= 2 * second_ttft + 1.0, (first_ttft, second_ttft)


def test_streams_greedy_ids_equal_to_transformers(triton, tokenizer, hf_greedy):
    prompt = tokenizer.encode(CHAT.format("What is the capital of France? Tell me about it.")).ids
    responses = _stream(triton["grpc"], "engine", _inputs(prompt, 16), {"llm_priority": 0})
    ids = [int(t) for r in responses for t in r.as_numpy("output_ids").reshape(-1)]
    expected = hf_greedy(prompt, 16)
    assert ids == expected[:len(ids)] and len(ids) >= 10   # EOS may end it before 16
    seq_index = {int(r.as_numpy("sequence_index")[0]) for r in responses}
    assert len(seq_index) == 1
    assert all(r.as_numpy("finish_reason")[0] == b"" for r in responses[:-1])
    final = responses[-1]
    assert final.as_numpy("finish_reason")[0] in (b"length", b"stop")
    assert final.as_numpy("usage").tolist() == [len(prompt), 0, len(ids)]


def test_ensemble_streams_text(triton):
    if "preprocessing" not in triton["steps"] or "postprocessing" not in triton["steps"]:
        pytest.skip("preprocessing/postprocessing models are not in the repository yet")
    import tritonclient.grpc as grpcclient

    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.asarray([CHAT.format("Name a colour.").encode()], dtype=np.object_))
    mt = grpcclient.InferInput("max_tokens", [1], "INT32")
    mt.set_data_from_numpy(np.asarray([8], dtype=np.int32))
    responses = _stream(triton["grpc"], "llm", [text, mt])
    out = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r in responses)
    assert out.strip()
    assert responses[-1].as_numpy("finish_reason")[0] in (b"length", b"stop")


def test_cancel_frees_blocks_and_metrics(triton):
    responses = _stream(triton["grpc"], "engine", _inputs(list(range(300, 500)), 1500), cancel_after=3)
    assert len(responses) == 3
    deadline = time.time() + 30
    while time.time() < deadline:
        m = _metrics(triton["metrics"])
        if m.get("fleet_engine_running") == 0 and m.get("fleet_engine_kv_blocks_used") == 0:
            break
        time.sleep(0.3)
    assert m["fleet_engine_running"] == 0 and m["fleet_engine_kv_blocks_used"] == 0, m
    for name in ("fleet_engine_kv_blocks_free", "fleet_engine_waiting", "fleet_engine_preemptions_total",
                 "fleet_engine_prefix_cache_hit_rate", "fleet_engine_tokens_per_s", "fleet_engine_ttft_seconds_count",
                 "fleet_engine_inter_token_latency_seconds_count"):
        assert name in m, name


def test_token_metrics_are_published_as_prometheus_histograms(triton):
    """The per-token numbers are kept in the replica and published on its tick (no server call per token):
    cumulative `_bucket{le}` series ending in +Inf == `_count`, and the tokens counter covers what was streamed."""
    before = _metrics(triton["metrics"]).get("fleet_engine_generated_tokens_total", 0.0)
    responses = _stream(triton["grpc"], "engine", _inputs(list(range(600, 640)), 24))
    streamed = sum(r.as_numpy("output_ids").size for r in responses)

    def histogram(name: str) -> tuple[dict[str, float], float]:
        text = urllib.request.urlopen(triton["metrics"], timeout=5).read().decode()
        buckets = {re.search(r'le="([^"]+)"', line).group(1): float(line.rsplit(" ", 1)[1])
                   for line in text.splitlines() if line.startswith(f"{name}_bucket{{")}
        counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"{name}_count{{")]
        assert f"# TYPE {name} histogram" in text, f"{name} is not exported as a histogram"
        return buckets, counts[0] if counts else 0.0

    def published() -> bool:
        m = _metrics(triton["metrics"])
        return m.get("fleet_engine_generated_tokens_total", 0.0) - before >= streamed
    wait_until(published, 10, "the generated-token counter to cover the streamed tokens")
    for name in ("fleet_engine_inter_token_latency_seconds", "fleet_engine_ttft_seconds"):
        buckets, count = histogram(name)
        values = [buckets[le] for le in sorted(buckets, key=float)]     # the server lists series in any order
        assert "+Inf" in buckets and values == sorted(values), buckets
        assert values[-1] == count > 0, (name, buckets, count)
    assert histogram("fleet_engine_inter_token_latency_seconds")[1] >= streamed - 1


def test_state_reports_reach_the_router(triton):
    prompt = list(range(1000, 1040))
    _stream(triton["grpc"], "engine", _inputs(prompt, 2))
    wanted = set(prefix_block_hashes(prompt, 16))

    def reports_with_the_prompt() -> list[dict]:
        reports = list(_Collector.reports)
        added = {h for rep in reports for h in rep.get("prefix_hashes_added", []) + rep.get("prefix_hashes", [])}
        return reports if len(reports) >= 3 and wanted <= added else []
    reports = wait_until(reports_with_the_prompt, 30, "state reports with the prompt's cached blocks")
    r = reports[-1]
    for key in ("replica_id", "model", "version", "region", "ts", "kv_blocks_total", "kv_blocks_free", "block_size",
                "running", "waiting", "queue_wait_ms_p95", "ttft_ms_p95", "tokens_per_s", "adapters_loaded",
                "prefix_hashes_added", "prefix_hashes_removed", "full_snapshot", "draining"):
        assert key in r, key
    assert r["replica_id"] == "test-replica" and r["block_size"] == 16 and r["kv_blocks_total"] == 511
    assert reports[0]["full_snapshot"] is True and "prefix_hashes" in reports[0]
    added = {h for rep in reports for h in rep.get("prefix_hashes_added", []) + rep.get("prefix_hashes", [])}
    assert set(prefix_block_hashes(prompt, 16)) <= added
