"""bench/engine/platform_profile's readings: histograms added up over label sets, what a burst added between two
scrapes, and which platform process a command line belongs to."""
from bench.engine.platform_profile import histogram, role, since

BEFORE = """# HELP fleet_router_dispatch_seconds x
fleet_router_dispatch_seconds_bucket{le="0.05",model="m",tier="standard"} 1.0
fleet_router_dispatch_seconds_bucket{le="0.05",model="m",tier="batch"} 0.0
fleet_router_dispatch_seconds_bucket{le="+Inf",model="m",tier="standard"} 1.0
fleet_router_dispatch_seconds_count{model="m",tier="standard"} 1.0
fleet_router_dispatch_seconds_sum{model="m",tier="standard"} 1.5
fleet_router_ttft_seconds_count{model="m",tier="standard"} 9.0
"""
AFTER = BEFORE.replace('tier="standard"} 1.0\nfleet_router_dispatch_seconds_bucket{le="0.05",model="m",tier="batch"} 0.0',
                       'tier="standard"} 3.0\nfleet_router_dispatch_seconds_bucket{le="0.05",model="m",tier="batch"} 1.0') \
    .replace('_count{model="m",tier="standard"} 1.0', '_count{model="m",tier="standard"} 3.0') \
    .replace('_sum{model="m",tier="standard"} 1.5', '_sum{model="m",tier="standard"} 1.55') \
    + 'fleet_router_dispatch_seconds_count{model="m",tier="batch"} 2.0\nfleet_router_dispatch_seconds_sum{model="m",tier="batch"} 0.05\n'


def test_a_burst_is_what_the_histogram_gained_between_scrapes():
    h0, h1 = histogram(BEFORE, "fleet_router_dispatch_seconds"), histogram(AFTER, "fleet_router_dispatch_seconds")
    assert h0 == {"count": 1.0, "sum": 1.5, "buckets": {"0.05": 1.0, "+Inf": 1.0}}
    gained = since(h1, h0)
    assert gained["count"] == 4.0 and gained["within_50ms"] == 3.0
    assert abs(gained["mean_ms"] - 25.0) < 1e-9          # (1.55 + 0.05 - 1.5) s over 4 requests
    assert since(h0, h0) == {"count": 0.0, "mean_ms": None, "within_50ms": 0.0}


def test_processes_are_named_by_their_role():
    assert role("/x/tritonserver/backends/python/triton_python_backend_stub /x/model.py") == \
        "replica (python backend stub)"
    assert role("/x/tritonserver/bin/tritonserver --model-repository=/x") == "tritonserver"
    assert role("/venv/bin/python -m router_service") == "router"
    assert role("/venv/bin/python -m fleet.cli usage load") == "usage loader"
    assert role("/bin/bash -c sleep 1") is None
