"""The GPU replica's state reporter: metric parsing, the don't-trust-a-metric-that-never-moved rule, drain."""
from __future__ import annotations

from python_backends.trtllm_state import MovedMetrics, build_report, busy, parse

SCRAPE = """# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{{model="tensorrt_llm",request_type="active",version="1"}} {active}
nv_trt_llm_request_metrics{{model="tensorrt_llm",request_type="max",version="1"}} 64
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="max",model="tensorrt_llm",version="1"}} 4096
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="free",model="tensorrt_llm",version="1"}} {free}
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"}} 64
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{{model="llm",version="1"}} {pending}
nv_inference_pending_request_count{{model="tensorrt_llm",version="1"}} 0
"""
ID = {"replica_id": "r1", "model": "m", "version": "1", "region": "local"}


def test_metrics_that_never_move_are_left_out_then_used_once_they_move() -> None:
    seen = MovedMetrics()
    idle = parse(SCRAPE.format(active=0, free=4096, pending=0))
    seen.observe(idle)
    report = build_report(ID, idle, seen)
    assert report["block_size"] == 64 and report["prefix_hashes_reported"] is False
    assert "running" not in report and "kv_blocks_free" not in report  # issue 49: could be a dead 0
    busy_now = parse(SCRAPE.format(active=3, free=4000, pending=2))
    seen.observe(busy_now)
    report = build_report(ID, busy_now, seen)
    assert (report["running"], report["kv_blocks_free"], report["kv_blocks_total"], report["waiting"]) == (3, 4000,
                                                                                                           4096, 2)


def test_drain_counts_executing_requests_not_only_pending_ones() -> None:
    assert busy(parse(SCRAPE.format(active=2, free=4000, pending=0))) == 2  # pending alone would say 0
    assert busy(parse(SCRAPE.format(active=0, free=4096, pending=1))) == 1
    assert busy(parse(SCRAPE.format(active=0, free=4096, pending=0))) == 0
