"""The `fleet_engine_*` counters a GPU (TensorRT-LLM) replica exports, from its Python ensemble steps.

TensorRT-LLM is the engine there, so only what the ensemble's Python models see is ours to count, with the CPU
engine's names and labels (`replica_id`, `model`, `version`, python_backends/engine/metrics.py) so dashboards and
rules work on both kinds of replica:
- `fleet_engine_prefix_cache_queried_tokens_total`: prompt tokens of each request (GPU preprocessing);
- `fleet_engine_generated_tokens_total`: tokens streamed back (GPU postprocessing).
The rest comes from Triton and the backend on the same metrics port (docs/observability.md, "GPU replicas"):
TTFT = `nv_inference_first_response_histogram_ms{model="llm"}` (--metrics-config histogram_latencies=true), KV
blocks and active requests = `nv_trt_llm_kv_cache_block_metrics` / `nv_trt_llm_request_metrics`.

Every metric call from the Python backend is a round trip to the server, so counts are added in-process and
published by one thread every `FLUSH_S` (as the CPU engine publishes on its tick).
"""
from __future__ import annotations

import threading
from typing import Any

FLUSH_S = 0.2
DESCRIPTIONS = {
    "fleet_engine_prefix_cache_queried_tokens_total": "prompt tokens looked up in the prefix cache",
    "fleet_engine_generated_tokens_total": "tokens generated",
}


class GpuCounters:
    """Counters of one Python model instance; `add` is cheap (no server call), a daemon thread publishes."""

    def __init__(self, pb_utils: Any, names: tuple[str, ...], labels: dict[str, str]) -> None:
        fam = pb_utils.MetricFamily
        # Triton requires each MetricFamily to outlive its Metrics: both stay referenced here
        self._families = {n: fam(name=n, description=DESCRIPTIONS[n], kind=fam.COUNTER) for n in names}
        self._metrics = {n: f.Metric(labels=labels) for n, f in self._families.items()}
        self._pending = dict.fromkeys(names, 0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="gpu-metrics", daemon=True).start()

    def add(self, name: str, value: int) -> None:
        with self._lock:
            self._pending[name] += value

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, dict.fromkeys(self._pending, 0)
        for name, value in pending.items():
            if value:
                self._metrics[name].increment(value)

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_S):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self.flush()


def replica_labels() -> dict[str, str]:
    """The CPU engine's labels, from the replica's environment (FLEET_REPLICA_ID, FLEET_MODEL, FLEET_VERSION)."""
    from python_backends.engine.state_report import identity_from_env
    identity = identity_from_env()
    return {"replica_id": identity["replica_id"], "model": identity["model"] or "llm",
            "version": str(identity["version"] or "")}
