"""bench.engine.step_ab: settings are checked before anything is built, and the two engines get the same work,
stepped in turns."""
from __future__ import annotations

import pytest

from bench.engine.step_ab import alternate, build, parse_settings


def test_settings_are_named_and_checked():
    assert parse_settings(["cpu_matmul=int8", "threads=1"]) == {"cpu_matmul": "int8", "threads": "1"}
    with pytest.raises(ValueError, match="'no_such=1'.*cpu_matmul"):
        parse_settings(["no_such=1"])
    with pytest.raises(ValueError, match="'threads'.*key=value"):
        parse_settings(["threads"])
    with pytest.raises(ValueError, match="threads.*abc"):
        build("/nonexistent", {"threads": "abc"}, streams=2)


def test_both_engines_step_the_same_work_in_turns(make_engine):
    engines = {"A": make_engine(), "B": make_engine(cpu_decode_attention="sdpa")}
    times = alternate(engines, streams=3, tokens=5, rounds=2, skip=1)
    assert len(times["A"]) == len(times["B"]) > 0          # the same steps on each side
    assert all(t > 0 for side in times.values() for t in side)
    assert not any(e.has_work() for e in engines.values())
    assert engines["A"].steps == engines["B"].steps        # every step counted by the engines themselves
