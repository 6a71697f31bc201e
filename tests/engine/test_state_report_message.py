"""The state report is one typed message: the engine's reporter builds it from real engine parts (KV cache,
scheduler, stats; no weights needed) and the router's state table takes exactly that, refusing anything else."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from common.hashing import prefix_block_hashes
from common.replica_report import ReplicaReport
from python_backends.engine.config import EngineConfig
from python_backends.engine.kv_cache_manager import KVCacheManager
from python_backends.engine.metrics import EngineStats
from python_backends.engine.scheduler import Scheduler
from python_backends.engine.sequence import SamplingParams, Sequence
from python_backends.engine.state_report import StateReporter
from router_service.replica_state import ReplicaStateTable

IDENTITY = {"replica_id": "m-v1-r0", "model": "m", "version": "1", "region": "local", "routers": []}


def _engine_parts() -> SimpleNamespace:
    config = EngineConfig(weights_dir="(none)", num_kv_blocks=32, block_size=16)
    kv = KVCacheManager(config.num_kv_blocks, config.block_size)
    scheduler = Scheduler(config, kv, acquire_lora=lambda s: True, release_lora=lambda s: None)
    return SimpleNamespace(config=config, kv=kv, scheduler=scheduler, stats=EngineStats(), lora=None)


def _cache_prompt(engine: SimpleNamespace, prompt: list[int]) -> None:
    seq = Sequence(prompt, SamplingParams())
    engine.kv.admit(seq, engine.kv.match_prefix(seq))
    engine.kv.ensure(seq, len(prompt))
    seq.num_computed = len(prompt)
    engine.kv.commit(seq)
    engine.kv.free(seq)


def test_engine_report_is_what_the_router_reads() -> None:
    engine, table = _engine_parts(), ReplicaStateTable()
    reporter = StateReporter(IDENTITY)
    first = list(range(100, 148))
    _cache_prompt(engine, first)
    full = reporter.build(engine)
    assert ReplicaReport.model_validate(full).full_snapshot
    table.apply(full)
    assert table.cached_blocks("m-v1-r0", prefix_block_hashes(first, 16)) == 3
    second = list(range(500, 532))
    _cache_prompt(engine, second)
    delta = reporter.build(engine)
    assert not delta["full_snapshot"] and len(delta["prefix_hashes_added"]) == 2
    table.apply(delta)
    assert table.cached_blocks("m-v1-r0", prefix_block_hashes(second, 16)) == 2
    assert table.summary("m-v1-r0")["kv_blocks_total"] == 31


@pytest.mark.parametrize("bad, field", [({"running": -1}, "running"),
                                        ({"prefix_hashes_added": "1,2"}, "prefix_hashes_added"),
                                        ({"colour": "red"}, "colour"), ({"replica_id": "../x"}, "replica_id")])
def test_router_refuses_a_report_that_does_not_fit(bad: dict, field: str) -> None:
    table = ReplicaStateTable()
    with pytest.raises(ValidationError, match=field):
        table.apply({"replica_id": "r0", **bad})
    assert table.states == {}
