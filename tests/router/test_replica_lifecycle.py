"""Replica lifecycle in the router over a real registry (SQLite; no replica processes: admission only
reserves slots): requests wait for starting replicas up to their deadline and fail fast only when
nothing serves or starts; a rollout's share moves to a version only as its replicas become ready."""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from datetime import datetime, timedelta, timezone

import pytest

from registry import queries
from registry.db import migrate, session_scope
from registry.schema import Replica, WarmBuffer
from router_service.core import Router
from router_service.errors import RouterError
from router_service.gateway import Gateway
from router_service.registry_cache import RegistryCache, load_snapshot
from router_service.replica_choice import ChoiceParams
from router_service.request import GenerateRequest
from router_service.rollout import shift_by_readiness


@pytest.fixture
def db(sqlite_url, smollm2_dir):
    migrate(sqlite_url)
    with session_scope(sqlite_url) as s:
        for v in ("1", "2"):  # real tokenizer files: the router checks prompt ids against the vocabulary
            queries.upsert_model_version(s, "m", v, status="serving" if v == "1" else "staged", max_context=2048,
                                         weights_uri=str(smollm2_dir))
        queries.set_routes(s, "m", {"1": 100}, actor="seed")
        s.add(WarmBuffer(model="m", version="1", min_idle_replicas=0, min_replicas=1, max_replicas=2))
        queries.create_caller(s, "dev", "t", canary_access=True)  # may pin a staged version
    return sqlite_url


def _replica(db: str, rid: str, version: str, state: str, started_ago_s: float = 0.0) -> None:
    with session_scope(db) as s:
        queries.upsert_replica(s, rid, model="m", version=version, region="local", grpc_url="127.0.0.1:1",
                               http_url="http://x", state=state)
        s.flush()
        s.get(Replica, rid).started_at = datetime.now(timezone.utc) - timedelta(seconds=started_ago_s)


def _router(db: str, start_wait_s: float = 600.0) -> Router:
    return Router(RegistryCache(db), choice=ChoiceParams(replica_concurrency=4), gateway=Gateway(1000, 1000),
                  start_wait_s=start_wait_s)


def _reload(router: Router) -> None:
    router.registry.snapshot = load_snapshot(router.registry.db_url)


def _caller(router: Router):
    return next(iter(router.registry.snapshot.callers_by_hash.values()))


def _req(i: int, version: str = "", deadline_in_s: float | None = None, session: str = "") -> GenerateRequest:
    deadline = int((time.time() + deadline_in_s) * 1000) if deadline_in_s is not None else None
    return GenerateRequest(request_id=f"r{i}", model="m", version=version, prompt_ids=list(range(20)), max_tokens=4,
                           deadline_ms=deadline, session=session)


def test_requests_wait_for_a_starting_replica_and_are_placed_once_it_serves(db):
    _replica(db, "m-v1-r0", "1", "starting")
    router = _router(db)

    async def main():
        waiting = [asyncio.create_task(router.prepare(_caller(router), _req(i))) for i in range(3)]
        for _ in range(300):  # until all three passed their quota check and wait in the queue
            if "m:1" in router.queues and len(router.queues["m:1"].waiting) == 3:
                break
            await asyncio.sleep(0.05)
        assert not any(t.done() for t in waiting)  # the replica is still loading: nobody fails, nobody is placed
        assert len(router.queues["m:1"].waiting) == 3
        _replica(db, "m-v1-r0", "1", "serving")
        _reload(router)  # what the registry watcher does within ~0.5 s
        placed = await asyncio.wait_for(asyncio.gather(*waiting), 30)
        assert {p.placement.replica.replica_id for p in placed} == {"m-v1-r0"}
        for p in placed:
            router.release_unstarted(p)
    asyncio.run(main())


def test_a_starting_replica_that_never_serves_ends_at_the_deadline(db):
    _replica(db, "m-v1-r0", "1", "starting")
    router = _router(db)
    with pytest.raises(RouterError) as info:
        asyncio.run(router.prepare(_caller(router), _req(0, deadline_in_s=0.3)))
    assert info.value.code == "deadline_exceeded" and "admission queue of m:1" in info.value.message


def test_waiters_fail_at_once_when_the_start_fails_and_nothing_else_starts(db):
    _replica(db, "m-v1-r0", "1", "starting")
    router = _router(db)

    async def main():
        waiting = asyncio.create_task(router.prepare(_caller(router), _req(0)))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        with session_scope(db) as s:  # the actuator deletes the row of a replica that failed to start
            queries.delete_replica(s, "m-v1-r0")
        _reload(router)
        with pytest.raises(RouterError) as info:
            await asyncio.wait_for(waiting, 30)
        return info.value
    err = asyncio.run(main())
    assert err.code == "unavailable" and "nothing serves or starts m version 1" in err.message
    assert router.quotas.usage_today("dev")["reserved"] == 0


def test_nothing_serves_or_starts_fails_fast_naming_model_and_version(db):
    _replica(db, "m-v1-r0", "1", "starting", started_ago_s=900)  # a stale row (its starter died) does not count
    router = _router(db, start_wait_s=600)
    with pytest.raises(RouterError) as info:  # no deadline: a request that waited would never end
        asyncio.run(asyncio.wait_for(router.prepare(_caller(router), _req(0)), 30))
    assert info.value.code == "unavailable" and info.value.http_status == 503
    assert "nothing serves or starts m version 1 in region 'local'" in info.value.message
    assert info.value.retry_after_ms


def test_rollout_to_a_version_without_ready_replicas_keeps_its_share_pending(db):
    _replica(db, "m-v1-r0", "1", "serving")
    with session_scope(db) as s:
        queries.set_routes(s, "m", {"1": 80, "2": 20}, actor="op")
    router = _router(db)
    caller = _caller(router)
    notes = [r.note() for r in router.readiness("m", "local")]
    assert notes == ["v1: 1 of 1 replicas ready, carrying 100 % (configured 80 %)",
                     "v2: 0 of 1 replicas ready, 20 % pending"]
    picked = Counter(router.resolve_model(caller, _req(i, session=f"s{i}")).version for i in range(400))
    assert picked == {"1": 400}  # nothing goes to v2 while it has no ready replica
    _replica(db, "m-v2-r1", "2", "starting")
    _reload(router)
    assert Counter(router.resolve_model(caller, _req(i, session=f"s{i}")).version for i in range(400)) == {"1": 400}
    _replica(db, "m-v2-r1", "2", "serving")  # v2 inherits v1's warm buffer: 1 replica needed
    _reload(router)
    picked = Counter(router.resolve_model(caller, _req(i, session=f"s{i}")).version for i in range(2000))
    assert 0.16 < picked["2"] / 2000 < 0.24, picked
    assert [r.note() for r in router.readiness("m", "local")][1] == "v2: 1 of 1 replicas ready, 20 %"


def test_promote_to_a_version_still_starting_keeps_the_serving_version_in_use(db):
    _replica(db, "m-v1-r0", "1", "serving")
    _replica(db, "m-v2-r1", "2", "starting")
    with session_scope(db) as s:
        queries.set_routes(s, "m", {"2": 100}, actor="op")
        queries.set_model_status(s, "m", "2", "serving")
    router = _router(db)
    caller = _caller(router)
    assert {router.resolve_model(caller, _req(i, session=f"s{i}")).version for i in range(200)} == {"1"}
    assert [r.note() for r in router.readiness("m", "local")] == [
        "v1: 1 of 1 replicas ready, carrying 100 % (configured 0 %)", "v2: 0 of 1 replicas ready, 100 % pending"]
    _replica(db, "m-v2-r1", "2", "serving")
    _reload(router)
    assert {router.resolve_model(caller, _req(i, session=f"s{i}")).version for i in range(200)} == {"2"}


def test_a_pinned_version_with_nothing_serving_or_starting_fails_fast(db):
    _replica(db, "m-v1-r0", "1", "serving")
    router = _router(db)
    with pytest.raises(RouterError) as info:
        asyncio.run(router.prepare(_caller(router), _req(0, version="2")))
    assert info.value.code == "unavailable" and "nothing serves or starts m version 2" in info.value.message


def test_partial_readiness_shifts_in_proportion():
    ready = {"1": (2, 2), "2": (1, 2)}
    got = {r.version: r.effective for r in shift_by_readiness({"1": 60, "2": 40}, ready)}
    assert got == {"1": 80.0, "2": 20.0}
    promoted = {r.version: r.effective for r in shift_by_readiness({"2": 100}, {"1": (1, 1), "2": (1, 2)})}
    assert promoted == {"1": 50.0, "2": 50.0}  # a promote moves traffic only as fast as v2's replicas get ready
    nothing = {r.version: r.effective for r in shift_by_readiness({"1": 60, "2": 40}, {"1": (0, 1), "2": (0, 1)})}
    assert nothing == {"1": 60.0, "2": 40.0}  # nothing serves: the configured split stands (requests wait or fail)
