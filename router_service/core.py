"""The router's request path: authenticate, resolve model/version/adapter, tokenise, admit (queue for
a replica slot), proxy the stream (resuming on another replica if one dies), and emit one usage event.

Frontends call `authenticate`, then `prepare` (all caller errors, shedding and queueing happen here,
before any byte is streamed; on success a replica slot is reserved), then iterate `stream`, and call
`release_unstarted` in a `finally` in case `stream` never ran. A request's total deadline (the earlier of the
caller's deadline_ms and its tier's stream deadline) counts from its arrival, queue wait included. `begin_stop`
(SIGTERM) refuses new and queued requests with UNAVAILABLE; running streams go on (docs/router.md, Stopping).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

from router_service import metrics, tracing
from router_service.admission import AdmissionQueue
from router_service.batch_yield import BatchYield
from router_service.cancellation import InflightRequests
from router_service.errors import RouterError, router_stopping
from router_service.fair_queue import FairShare
from router_service.gateway import Gateway, QuotaLedger
from router_service.regions import candidate_tiers, home_region
from router_service.registry_cache import CallerInfo, ModelInfo, RegistryCache, ReplicaInfo
from router_service.replica_choice import ChoiceParams, Placement, ReplicaChooser
from router_service.replica_probe import Healing, ReplicaProber
from router_service.replica_state import ReplicaStateTable
from router_service.replica_set import ReplicaSet
from router_service.request import DEFAULT_MAX_TOKENS, Finished, GenerateRequest, Prepared, TokenDelta
from router_service.rollout import VersionReadiness
from router_service.stream_proxy import proxy_stream
from router_service.stream_guard import StreamTimeouts
from router_service.tokenization import TokenizerCache
from router_service.upstream import ReplicaClient
from router_service.visibility import resolve_model

log = logging.getLogger(__name__)
INLINE_TOKENIZE_CHARS = 2000


class Router:
    def __init__(self, registry: RegistryCache, usage_producer=None, region: str = "local",
                 choice: ChoiceParams | None = None, gateway: Gateway | None = None, max_waiting: int = 256,
                 batch_yield: BatchYield | None = None, start_wait_s: float = 600.0,
                 timeouts: StreamTimeouts | None = None, healing: Healing | None = None,
                 default_max_tokens: dict[str, int] | None = None) -> None:
        self.registry = registry
        self.usage = usage_producer
        self.region = region
        self.tokenizers = TokenizerCache()
        self.clients: dict[str, ReplicaClient] = {}
        self.replica_state = ReplicaStateTable()
        self.healing = healing or Healing()
        self.replicas = ReplicaSet(registry, self.replica_state, start_wait_s, self.healing.recover_wait_s)
        self.cordoned = self.replicas.cordoned  # replica -> monotonic time the router cordoned it
        self.chooser = ReplicaChooser(self.replica_state, choice)
        self.gateway = gateway or Gateway()
        self.quotas = QuotaLedger(registry.db_url)
        self.queues: dict[str, AdmissionQueue] = {}
        self.max_waiting = max_waiting
        self.requests = InflightRequests()
        self.batch_yield = batch_yield or BatchYield()
        self.timeouts = timeouts or StreamTimeouts()
        self.prober = ReplicaProber(registry, self.replicas, self.client_for, self.healing.probe)
        # max_tokens of a request that sets none: the rest of the context, at most this per tier
        self.default_max_tokens = dict(default_max_tokens or DEFAULT_MAX_TOKENS)
        self.stopping = False  # set once by begin_stop: nothing new starts
        self.stop_hooks: list[Callable[[], None]] = []  # frontends' wake-ups for begin_stop (idle gRPC streams)

    @property
    def inflight(self) -> dict[str, int]:
        return self.chooser.inflight

    # --- gateway -----------------------------------------------------------------------------------
    def authenticate(self, api_key: str | None) -> CallerInfo:
        if not api_key:
            raise RouterError("unauthenticated", "missing API key: send 'authorization: Bearer <key>'")
        caller = self.registry.caller_for_key(api_key)
        if caller is None:
            raise RouterError("unauthenticated", "unknown API key")
        return caller

    def resolve_model(self, caller: CallerInfo, req: GenerateRequest) -> ModelInfo:
        """The version `req` runs on (visibility rules), splitting by the shares versions can carry now."""
        home = home_region(caller.region, self.region)
        return resolve_model(self.registry.snapshot, caller, req,
                             lambda: {r.version: r.effective for r in self.readiness(req.model, home)})

    async def prepare(self, caller: CallerInfo, req: GenerateRequest, arrived: float | None = None) -> Prepared:
        """Validate, tokenise, check quota, and wait for a replica slot (admission queue). `arrived`: when the
        frontend got the request (monotonic; now by default): its total deadline counts from then."""
        arrived = time.monotonic() if arrived is None else arrived
        try:
            if self.stopping:
                raise router_stopping(req.request_id)
            self.gateway.check_rate(caller.name)
            model = self.resolve_model(caller, req)
            req.validate(model.max_context)
            if req.deadline_ms is not None and req.deadline_ms <= time.time() * 1000:
                raise RouterError("deadline_exceeded", f"deadline_ms {req.deadline_ms} has already passed")
            vocab_size, max_token_chars = await self._limits(model)
            req.check_prompt_size(model.max_context, vocab_size, max_token_chars)
            req.check_sampling(vocab_size)
            if req.prompt_ids is None:
                req.prompt_ids = await self._tokenize(model, req)
            req.check_prompt_fits(model.max_context, self.default_max_tokens[req.tier])
            if req.seed is None and req.temperature > 0:  # so that a resumed stream continues the same draws
                req.seed = secrets.randbits(63)
            p = Prepared(req, caller, model, list(req.prompt_ids), arrived=arrived,
                         home=home_region(caller.region, self.region))
            p.quota_reserved = len(p.prompt_ids) + req.max_tokens
            p.budget_warning = await self.quotas.admit_caller(caller, self.registry.snapshot.budgets.get(caller.team),
                                                              req.request_id, model.name, len(p.prompt_ids),
                                                              req.max_tokens)
        except RouterError as exc:
            metrics.REJECTED.labels(exc.code).inc()
            tracing.refused(exc.code)
            raise
        tracing.annotate(p)
        p.handle = self.requests.register(req.request_id, caller.name)
        try:
            p.placement = await self.admit(p, set(), p.prompt_ids, req.max_tokens)
        except BaseException as exc:
            self.requests.unregister(p.handle)
            self.quotas.settle(req.request_id, 0)
            if isinstance(exc, RouterError):
                metrics.REJECTED.labels(exc.code).inc()
                tracing.refused(exc.code)
            raise
        return p

    async def _limits(self, model: ModelInfo) -> tuple[int, int]:
        """(vocab size, max characters per token) of the model's tokenizer (loaded off the event loop once)."""
        if self.tokenizers.loaded(model.weights_uri):
            return self.tokenizers.limits(model.weights_uri)
        return await asyncio.to_thread(self.tokenizers.limits, model.weights_uri)

    async def _tokenize(self, model: ModelInfo, req: GenerateRequest) -> list[int]:
        """Short prompts inline (a thread hop costs more than encoding them); long ones off the event loop."""
        size = len(req.prompt_text or "") if req.chat_messages is None else sum(len(m["content"]) for m in req.chat_messages)
        loaded = self.tokenizers.loaded(model.weights_uri)
        if req.chat_messages is not None:
            fn, arg = functools.partial(self.tokenizers.encode_chat, tools=req.tools), req.chat_messages
        else:
            fn, arg = self.tokenizers.encode, req.prompt_text or ""
        if loaded and size <= INLINE_TOKENIZE_CHARS:
            return fn(model.weights_uri, arg)
        return await asyncio.to_thread(fn, model.weights_uri, arg)

    # --- admission and replicas ------------------------------------------------------------------------
    def serving_replicas(self, model: ModelInfo, exclude: set[str]) -> list[ReplicaInfo]:
        return self.replicas.serving(model, exclude)

    def readiness(self, model: str, region: str) -> list[VersionReadiness]:
        """Each version's ready replicas and effective share of the split in `region`."""
        return self.replicas.readiness(model, region)

    def queue_for(self, model: ModelInfo) -> AdmissionQueue:
        key = f"{model.name}:{model.version}"
        queue = self.queues.get(key)
        if queue is None:
            queue = self.queues[key] = AdmissionQueue(key, self.max_waiting)
        return queue

    async def admit(self, p: Prepared, exclude: set[str], ids: list[int], max_tokens: int) -> Placement:
        """Reserve a slot on the best replica for prompt `ids`, waiting in the model version's admission
        queue if none has room now or if its replicas are still starting, up to the request's total deadline
        (counted from its arrival); a stopping router starts nothing new (its queued requests are refused)."""
        req = p.req
        end = self.timeouts.total_deadline(req.tier, p.arrived, req.deadline_ms)
        if self.stopping and not p.started:
            raise router_stopping(req.request_id)
        if end.passed():
            raise end.queued_error(f"{p.model.name}:{p.model.version}", 0.0)
        if self.replicas.must_wait(p.model, p.home, req.tier, exclude):
            log.info("request %s waits for a starting replica of %s version %s", req.request_id, p.model.name,
                     p.model.version)
        key = f"{p.model.name}:{p.model.version}"

        def try_place() -> Placement | None:
            if self.replicas.must_wait(p.model, p.home, req.tier, exclude):  # raises once none starts
                return None
            if req.tier == "batch" and not self.batch_yield.batch_may_start(key):
                return None
            groups = candidate_tiers(self.serving_replicas(p.model, exclude), p.home, req.tier)
            for i, group in enumerate(groups):
                if not group:
                    continue
                block_size = self.chooser.block_size(group)
                hashes = p.hashes(ids, block_size) if block_size else None
                placed = self.chooser.place(group, req.tier, len(ids), max_tokens, hashes, req.adapter)
                if placed is not None:
                    rid = placed.replica.replica_id
                    metrics.PLACEMENTS.labels(p.model.name, placed.policy, "home" if i == 0 else "overflow").inc()
                    metrics.INFLIGHT.labels(rid).set(self.inflight[rid])
                    return placed
            return None

        def cancelled() -> bool:
            return p.handle is not None and p.handle.cancelled

        def stop_waiting() -> bool:
            """The queue's cancel check (every REPUMP_S): also the router stopping and the total deadline.
            The queue orders tickets by the caller's deadline_ms only: the stream deadline, which every
            request has, would turn the fair shares within a tier into arrival order."""
            return cancelled() or (self.stopping and not p.started) or end.passed()

        if req.tier == "interactive":
            self.batch_yield.interactive_arrived(key)
        queued_at = time.monotonic()
        with tracing.admission_span(req.tier) as span:
            try:
                placement = await self.queue_for(p.model).admit(
                    req.tier, req.deadline_ms, try_place, self.release_slot, req.request_id, stop_waiting,
                    FairShare(p.caller.team, p.caller.team_weight, len(ids) + max_tokens))
            except RouterError as exc:
                if exc.code not in ("cancelled", "deadline_exceeded") or cancelled():
                    raise
                waited = time.monotonic() - queued_at
                if self.stopping and not p.started:
                    metrics.SHED.labels(p.model.name, req.tier, "stopping").inc()
                    raise router_stopping(req.request_id, waited) from None
                if exc.code == "cancelled":  # the stream deadline (the queue counts its own deadline sheds)
                    metrics.SHED.labels(p.model.name, req.tier, end.reason).inc()
                log.info("%s of %s passed after %.2f s in the admission queue of %s", end.reason, req.request_id,
                         waited, key)
                raise end.queued_error(key, waited) from None
            tracing.placed(span, placement)
        return placement

    def begin_stop(self) -> int:
        """SIGTERM: refuse new requests and those waiting for a slot (UNAVAILABLE, retry elsewhere; queued ones
        notice within the queue's re-check period, 0.1 s); running streams go on. Returns how many wait."""
        self.stopping = True
        for hook in self.stop_hooks:
            hook()
        return sum(len(q.waiting) for q in self.queues.values())

    def release_slot(self, placement: Placement, model: ModelInfo | None = None, held_s: float | None = None) -> None:
        self.chooser.release(placement)
        rid = placement.replica.replica_id
        metrics.INFLIGHT.labels(rid).set(self.inflight.get(rid, 0))
        queue = self.queues.get(f"{placement.replica.model}:{placement.replica.version}")
        if queue is not None:
            if held_s is not None:
                queue.observe_service(held_s, max(1, len(self.inflight)) * self.chooser.params.replica_concurrency)
            queue.pump()

    def client_for(self, replica: ReplicaInfo) -> ReplicaClient:
        client = self.clients.get(replica.replica_id)
        if client is None:
            client = self.clients[replica.replica_id] = ReplicaClient(replica.replica_id, replica.grpc_url)
        return client

    def cordon(self, replica_id: str, why: str) -> None:
        self.replicas.cordon(replica_id, why)

    def cancel(self, request_id: str, caller: CallerInfo) -> None:
        if not self.requests.cancel(request_id, caller.name):
            raise RouterError("not_found", f"no request {request_id!r} of caller {caller.name!r} is in flight")

    # --- streaming -----------------------------------------------------------------------------------
    def release_unstarted(self, p: Prepared) -> None:
        """Give back the slot, quota reservation and id of a prepared request whose stream never ran."""
        if p.started:
            return
        p.started = True
        if p.placement is not None:
            self.release_slot(p.placement)
            p.placement = None
        self.quotas.settle(p.req.request_id, 0)
        if p.handle is not None:
            self.requests.unregister(p.handle)

    def stream(self, p: Prepared) -> AsyncIterator[TokenDelta | Finished]:
        """Proxy the generation (router_service/stream_proxy.py): resumes on another replica from prompt +
        emitted ids if one fails, and re-queues (then resumes) a batch stream preempted for interactive work."""
        return proxy_stream(self, p)

    def warm_tokenizers(self) -> None:
        """Load the tokenizers of served model versions ahead of the first request (run in a thread)."""
        for versions in self.registry.snapshot.models.values():
            for info in versions.values():
                try:
                    self.tokenizers.limits(info.weights_uri)
                except Exception as exc:  # a missing tokenizer is reported to the first caller that needs it
                    log.info("tokenizer for %s %s not preloaded: %s", info.name, info.version, exc)

    async def close(self) -> None:
        await self.prober.close()
        for client in self.clients.values():
            await client.close()

