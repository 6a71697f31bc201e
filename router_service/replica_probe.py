"""Probing replicas the router cordoned or holds as suspect, so that a cordon heals without an operator
(docs/reliability.md, Self-healing).

A probe is a tiny real request on the side: one greedy token from a one-token prompt, sent the way real
requests go (`ReplicaClient.generate`), with a timeout. The first probe goes `first_s` after the trouble,
then the interval doubles up to `max_interval_s`. A probe that answers puts the replica back: a cordon is
lifted (and the registry row set back to `serving`), a suspicion dropped. After `restart_after` probes in
a row fail, a suspect replica is cordoned too (probes failed: not timeouts alone), so the registry shows
it; the autoscaler's actuator restarts replicas whose registry row stays `cordoned`
(autoscale/actuators/local.py, `heal`), and a restart (a new pid) lifts the cordon too.

The prober runs as one asyncio task, started on the first trouble and ended when nothing is left to probe.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router_service import metrics
from router_service.registry_cache import RegistryCache, ReplicaInfo
from router_service.replica_set import ReplicaSet
from router_service.request import Finished, GenerateRequest, TokenDelta
from router_service.upstream import ReplicaClient, ReplicaFailed

log = logging.getLogger(__name__)
PROBE_PROMPT = [1]  # one token id every vocabulary has


@dataclass(frozen=True)
class ProbeSettings:
    first_s: float = 1.0          # first probe this long after the trouble
    max_interval_s: float = 8.0   # backoff cap between probes
    timeout_s: float = 5.0        # a probe answered later than this failed
    restart_after: int = 5        # failed probes in a row before the replica is reported for a restart


@dataclass(frozen=True)
class Healing:
    """How long a stream waits on a slow or suspect replica, and how cordoned ones are probed (settings:
    FLEET_ROUTER_SLOW_LIMIT_S, _RECOVER_WAIT_S, _PROBE_FIRST_S, _PROBE_MAX_INTERVAL_S, _PROBE_TIMEOUT_S,
    _PROBE_RESTART_AFTER; docs/reliability.md)."""
    slow_limit_s: float = 600.0     # a stream waits on a replica that steps but sends it nothing at most this long
    recover_wait_s: float = 120.0   # streams and new requests wait this long for a suspect last replica
    probe: ProbeSettings = field(default_factory=ProbeSettings)


@dataclass
class _Target:
    due: float
    interval: float
    failures: int = 0


class ReplicaProber:
    def __init__(self, registry: RegistryCache, replicas: ReplicaSet,
                 client_for: Callable[[ReplicaInfo], ReplicaClient], settings: ProbeSettings | None = None) -> None:
        self.registry = registry
        self.replicas = replicas
        self.client_for = client_for
        self.settings = settings or ProbeSettings()
        self.targets: dict[str, _Target] = {}
        self._task: asyncio.Task | None = None
        self._seq = 0
        replicas.on_trouble = self.watch

    def watch(self, replica_id: str) -> None:
        """Start probing a replica (called from the event loop when it is cordoned or suspected)."""
        if replica_id not in self.targets:
            first = self.settings.first_s
            self.targets[replica_id] = _Target(time.monotonic() + first, first)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _in_trouble(self, replica_id: str) -> bool:
        return replica_id in self.replicas.cordoned or replica_id in self.replicas.suspect

    async def _run(self) -> None:
        while self.targets:
            now = time.monotonic()
            for rid in [r for r in self.targets if not self._in_trouble(r)]:
                del self.targets[rid]  # healed otherwise (a restart, an operator, a token on a stream)
            due = [rid for rid, t in self.targets.items() if t.due <= now]
            if due:
                await asyncio.gather(*(self._probe_one(rid) for rid in due))
            wait = min((t.due for t in self.targets.values()), default=now) - time.monotonic()
            await asyncio.sleep(max(0.05, min(wait, 1.0)))

    async def _probe_one(self, replica_id: str) -> None:
        target = self.targets[replica_id]
        replica = next((r for r in self.registry.snapshot.replicas if r.replica_id == replica_id), None)
        if replica is None:  # gone from the registry: nothing to heal
            self.targets.pop(replica_id, None)
            self.replicas.answered(replica_id)
            self.replicas.cordoned.pop(replica_id, None)
            return
        ok, why = await self.probe(replica)
        metrics.PROBES.labels(replica_id, "ok" if ok else "failed").inc()
        if ok:
            self.targets.pop(replica_id, None)
            self.replicas.answered(replica_id)
            self.replicas.uncordon(replica_id, "a probe answered")
            return
        target.failures += 1
        target.interval = min(target.interval * 2, self.settings.max_interval_s)
        target.due = time.monotonic() + target.interval
        log.info("probe of replica %s failed (%d in a row): %s", replica_id, target.failures, why)
        if target.failures == self.settings.restart_after:
            log.error("replica %s failed %d probes in a row: cordoned for its actuator to restart it",
                      replica_id, target.failures)
            # a suspect that never answers is cordoned now (probes failed, not timeouts alone): the registry shows
            # it, the autoscaler counts it as missing capacity and its actuator restarts it; probing goes on
            self.replicas.cordon(replica_id, f"{target.failures} probes in a row failed: {why}")

    async def probe(self, replica: ReplicaInfo) -> tuple[bool, str]:
        """(answered, why not): one token from the replica within the probe timeout."""
        self._seq += 1
        req = GenerateRequest(request_id=f"probe-{replica.replica_id}-{self._seq}", model=replica.model,
                              prompt_ids=list(PROBE_PROMPT), max_tokens=1, tier="interactive")
        client = self.client_for(replica)

        async def one() -> bool:
            direct = await client.serves_engine()
            async for item in client.generate(req, req.prompt_ids, 1, direct=direct):
                if isinstance(item, (TokenDelta, Finished)):
                    return True
            return False
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                return (await one()), "no answer"
        except TimeoutError:
            return False, f"no answer within {self.settings.timeout_s:g} s"
        except ReplicaFailed as exc:
            return False, str(exc)
        except Exception as exc:  # any other failure to answer is a failed probe, never a crash of the prober
            return False, repr(exc)
