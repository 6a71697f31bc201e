"""The engine benchmark's repeated runs: medians per metric, run-by-run throughputs kept in order, and the
report's paired ratio range (bench/engine/peers.combine_runs, bench/engine/report_doc)."""
from bench.engine.peers import combine_runs
from bench.engine.report_doc import cpu_section


def _run(tok_s: float, ttft95: float, errors: int = 0, busy: float = 1.0) -> dict:
    return {"requests": 32, "errors": errors, "output_tokens": 4096, "throughput_tok_s": tok_s,
            "ttft_ms_p50": ttft95 / 2, "ttft_ms_p95": ttft95, "itl_ms_p50": 0.0, "tpot_ms_p50": 60.0,
            "tpot_ms_p95": None, "first_error": "boom" if errors else "", "load_avg_before": [1.0, 1.0, 1.0],
            "cpu_busy_before": busy}


def test_one_run_is_kept_as_it_is():
    run = _run(400.0, 900.0)
    assert combine_runs([run]) == run


def test_repeated_runs_give_medians_and_keep_every_run():
    combined = combine_runs([_run(400.0, 900.0), _run(300.0, 5000.0, errors=1, busy=9.0), _run(500.0, 800.0)])
    assert combined["throughput_tok_s"] == 400.0
    assert combined["ttft_ms_p95"] == 900.0               # the stalled run's 5 s does not decide the p95 shown
    assert combined["throughput_tok_s_runs"] == [400.0, 300.0, 500.0]   # run order: pairs with a peer's rounds
    assert combined["errors"] == 1 and combined["first_error"] == "boom"
    assert combined["cpu_busy_before"] == 9.0             # the busiest start is the one reported
    assert combined["tpot_ms_p95"] is None and combined["runs"] == 3


def test_report_shows_the_range_and_paired_ratios():
    ours = combine_runs([_run(400.0, 900.0), _run(300.0, 1000.0)])
    peer = combine_runs([_run(200.0, 1200.0), _run(100.0, 1100.0)])
    report = {"levels": ["burst-32"], "systems": {"platform": {"burst-32": ours}, "hf": {"burst-32": peer}},
              "started": "now", "load_avg": [0, 0, 0], "requests_per_level": {"burst-32": 32}, "rate": 4.0,
              "dtype": "bf16", "threads": 2, "repeats": 2, "path": "bench/results/x.json"}
    text = cpu_section(report, "python -m bench.engine.bench_engine --repeats 2")
    assert "| 350.0 (300-400) |" in text
    # medians 350 / 150 = 2.33x; round by round 400/200 = 2.00x and 300/100 = 3.00x
    assert "platform throughput 2.33x hf (rounds 2.00-3.00x)" in text
    assert "2 runs per system and level" in text
