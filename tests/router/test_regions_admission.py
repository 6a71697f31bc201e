"""Router admission over a registry with replicas in two regions (no replica processes: admission only
reserves slots): each region serves its own callers; only batch overflows; interactive waits at home."""
import asyncio

import pytest

from registry import queries
from registry.schema import Caller
from router_service.core import Router
from router_service.errors import RouterError
from router_service.gateway import Gateway
from router_service.registry_cache import RegistryCache
from router_service.replica_choice import ChoiceParams
from router_service.request import GenerateRequest


@pytest.fixture
def router(sqlite_url, seeded):
    def eu_caller(s):
        queries.create_caller(s, "eu-caller", "t")
        s.flush()
        s.get(Caller, "eu-caller").region = "eu"
    seeded(sqlite_url, replicas=[("eu-0", "eu"), ("us-0", "us")], extra=eu_caller)
    return Router(RegistryCache(sqlite_url), choice=ChoiceParams(replica_concurrency=1, batch_share=1.0),
                  gateway=Gateway(1000, 1000))


def _req(tier: str, i: int, deadline_ms=None) -> GenerateRequest:
    return GenerateRequest(request_id=f"{tier}-{i}", model="m", prompt_ids=list(range(40)), max_tokens=8, tier=tier,
                           deadline_ms=deadline_ms)


def test_only_batch_overflows_to_the_other_region(router):
    caller = next(c for c in router.registry.snapshot.callers_by_hash.values() if c.name == "eu-caller")

    async def main():
        first = await router.prepare(caller, _req("interactive", 0))
        assert first.placement.replica.replica_id == "eu-0"  # home region
        batch = await router.prepare(caller, _req("batch", 1))
        assert batch.placement.replica.replica_id == "us-0"  # home full: batch overflows
        import time
        with pytest.raises(RouterError) as info:  # interactive waits at home until its deadline
            await router.prepare(caller, _req("interactive", 2, int(time.time() * 1000) + 200))
        assert info.value.code == "deadline_exceeded"
        router.release_unstarted(first)
        waiting = asyncio.create_task(router.prepare(caller, _req("standard", 3)))
        placed = await asyncio.wait_for(waiting, 1)
        assert placed.placement.replica.replica_id == "eu-0"
        router.release_unstarted(placed)
        router.release_unstarted(batch)
        assert router.inflight == {"eu-0": 0, "us-0": 0}
        assert router.quotas.usage_today("eu-caller")["reserved"] == 0
    asyncio.run(main())
