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
from contextlib import aclosing

from router_service import metrics, tracing
from router_service.accounting import account, open_ledger_entry
from router_service.admission import AdmissionQueue
from router_service.batch_yield import BatchYield
from router_service.cancellation import CancelHandle, InflightRequests
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
from router_service.stream_judge import StreamJudge
from router_service.stream_guard import DeadlineReached, ReplicaHung, StreamText, StreamTimeouts, guarded
from router_service.tokenization import TokenizerCache
from router_service.upstream import Preempted, ReplicaClient, ReplicaFailed, ReplicaRefused
from router_service.visibility import resolve_model

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
# A request whose stream was running on two replicas when each died or hung is not tried on a third:
# it may be what kills them (a poison request), and each try would take another replica down.
MAX_REPLICA_KILLS = 2
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
                    req.tier, req.deadline_ms, try_place, self._release_slot, req.request_id, stop_waiting,
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

    def _release_slot(self, placement: Placement, model: ModelInfo | None = None, held_s: float | None = None) -> None:
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
            self._release_slot(p.placement)
            p.placement = None
        self.quotas.settle(p.req.request_id, 0)
        if p.handle is not None:
            self.requests.unregister(p.handle)

    async def stream(self, p: Prepared) -> AsyncIterator[TokenDelta | Finished]:
        """Proxy the generation; resumes on another replica from prompt + emitted ids if one fails, and
        re-queues (then resumes) a batch stream preempted for interactive work."""
        if p.started:
            raise RuntimeError("a prepared request streams once")
        p.started = True
        req, emitted, key = p.req, [], f"{p.model.name}:{p.model.version}"
        failed: set[str] = set()
        failures = 0
        first_token_at: float | None = None
        finish: Finished | None = None
        replica_id, status, placement = "", "error", p.placement
        cached_tokens = 0
        kills: list[str] = []  # replicas that died or hung while streaming this request
        text = StreamText()
        # the total stream deadline (per tier, from arrival) caps how long this stream may run; the caller's own
        # may be earlier
        end = self.timeouts.total_deadline(req.tier, p.arrived, req.deadline_ms)
        end_ms, end_reason = end.end_ms, end.reason
        ledger = open_ledger_entry(self.usage, p)
        if req.tier == "interactive":
            self.batch_yield.interactive_started(key)
        try:
            while True:
                if p.handle is not None and p.handle.cancelled:
                    finish = self._finished(p, "cancelled", emitted, replica_id, cached_tokens)
                    break
                if placement is None:
                    try:
                        placement = await self.admit(p, failed, p.prompt_ids + emitted, req.max_tokens - len(emitted))
                    except RouterError as exc:
                        if exc.code not in ("deadline_exceeded", "cancelled"):
                            raise
                        finish = self._finished(p, end_reason if exc.code == "deadline_exceeded" else "cancelled",
                                                emitted, replica_id, cached_tokens)
                        break
                replica_id = placement.replica.replica_id
                attempt_started, prefill_pending, attempt_error, judge = time.monotonic(), True, None, None
                attempt_span, req.trace_context = tracing.start_attempt(replica_id, failures + 1, len(emitted))
                if first_token_at is None and not failures:
                    metrics.DISPATCH.labels(req.model, req.tier).observe(attempt_started - p.arrived)
                if req.tier == "batch" and p.handle is not None:
                    p.handle.preempted = False
                    self.batch_yield.batch_started(key, p.handle)
                try:
                    client = self.client_for(placement.replica)
                    direct = await client.serves_engine()
                    if emitted or direct:  # a resume, or a replica that streams ids only: the router decodes
                        await self._decode_text_here(p, text, emitted)
                    upstream = client.generate(
                        req, p.prompt_ids + emitted, req.max_tokens - len(emitted), p.handle,
                        # seeded and guided streams continue from the emitted ids (random stream, grammar state)
                        seed_offset=len(emitted) if req.seed is not None or req.guided else 0,
                        direct=direct and text.decoding)
                    judge = StreamJudge(self.replica_state, self.replicas, self.healing, p.model, req.request_id,
                                        replica_id)
                    async with aclosing(guarded(upstream, self.timeouts.first_token_s[req.tier],
                                                self.timeouts.inter_token_s[req.tier], end_ms,
                                                judge)) as items:
                        async for item in items:
                            if judge.waited:  # it answered after a timeout: slow or resumed, not dead
                                judge.settle()
                            if isinstance(item, TokenDelta):
                                if first_token_at is None:
                                    first_token_at = time.monotonic()
                                    metrics.TTFT.labels(req.model, req.tier).observe(first_token_at - p.arrived)
                                if prefill_pending:
                                    prefill_pending = False
                                    self.chooser.progress(placement, placement.load - (req.max_tokens - len(emitted)))
                                self.chooser.progress(placement, len(item.token_ids))
                                emitted.extend(item.token_ids)
                                if ledger is not None:
                                    ledger.progress(len(emitted))
                                yield text.delta(item)
                            else:
                                tail = text.tail()
                                if tail:
                                    yield TokenDelta(tail, [])
                                cached_tokens = item.cached_prompt_tokens if not cached_tokens else cached_tokens
                                finish = self._finished(p, item.finish_reason, emitted, replica_id, cached_tokens)
                    break
                except DeadlineReached:
                    log.info("%s of %s passed while waiting on replica %s (%d tokens streamed)", end_reason,
                             req.request_id, replica_id, len(emitted))
                    finish = self._finished(p, end_reason, emitted, replica_id, cached_tokens)
                    break
                except ReplicaRefused as exc:
                    if emitted:  # refused on resume: this replica cannot continue it; another may
                        raise RouterError("replica_failure", f"request {req.request_id} could not be resumed after "
                                          f"{len(emitted)} tokens: {exc}") from exc
                    raise RouterError("engine_refused", f"the replica refused the request: {exc}") from exc
                except Preempted:
                    log.info("batch request %s preempted on %s after %d tokens; re-queued", req.request_id,
                             replica_id, len(emitted))
                except ReplicaFailed as exc:
                    attempt_error = exc
                    failures += 1
                    failed.add(replica_id)
                    log.warning("replica %s failed during %s after %d tokens (attempt %d): %s", replica_id,
                                req.request_id, len(emitted), failures, exc)
                    if isinstance(exc, ReplicaHung):
                        metrics.STREAM_TIMEOUTS.labels(replica_id).inc()
                        if self.replicas.is_last(p.model, replica_id):
                            # never cordoned on timeouts alone: it stays suspect and probed; nothing else serves
                            self.replicas.suspect_replica(replica_id, f"stream of {req.request_id}: {exc}")
                            raise RouterError("unavailable", f"replica {replica_id}, the only one serving "
                                              f"{p.model.name} version {p.model.version}, stopped responding ({exc}; "
                                              f"no state report either); {len(emitted)} tokens were streamed and are "
                                              f"billed; it is being probed and serves again once it answers",
                                              retry_after_ms=int(self.healing.probe.max_interval_s * 1000)) from exc
                    if not exc.alive:  # a replica that answers with an error stays in service
                        kills.append(replica_id)
                        self.cordon(replica_id, f"stream of {req.request_id} broke: {exc}")
                    if end_ms <= time.time() * 1000:
                        log.info("not retrying %s: its %s has passed", req.request_id, end_reason)
                        finish = self._finished(p, end_reason, emitted, replica_id, cached_tokens)
                        break
                    if len(kills) >= MAX_REPLICA_KILLS:
                        metrics.POISONED.labels(req.model).inc()
                        log.error("request %s not retried: replicas %s died or hung while serving it (poison "
                                  "request?)", req.request_id, ", ".join(kills))
                        raise RouterError("replica_failure", f"request {req.request_id} was stopped: the replicas "
                                          f"serving it ({', '.join(kills)}) died or hung, so it is not tried on "
                                          f"a third; {len(emitted)} tokens were streamed and are billed") from exc
                    if failures == MAX_ATTEMPTS:
                        raise RouterError("unavailable", f"request failed on {MAX_ATTEMPTS} replicas: {exc}") from exc
                    metrics.RETRIES.labels(req.model).inc()
                    if emitted:
                        metrics.RESUMES.labels(req.model).inc()
                        log.info("resuming %s on another replica from prompt + %d emitted tokens", req.request_id,
                                 len(emitted))
                finally:
                    tracing.end_attempt(attempt_span, len(emitted), attempt_error)
                    if judge is not None:
                        judge.settle_hold()
                    if req.tier == "batch" and p.handle is not None:
                        self.batch_yield.batch_ended(key, p.handle)
                    self._release_slot(placement, p.model, time.monotonic() - attempt_started)
                    placement = p.placement = None
            status = "ok"
            if finish is not None:
                if finish.finish_reason == "cancelled":
                    metrics.CANCELS.labels(req.model, "by_id").inc()
                yield finish
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            metrics.CANCELS.labels(req.model, "disconnect").inc()
            raise
        finally:
            if req.tier == "interactive":
                self.batch_yield.interactive_ended(key)
            if placement is not None:  # cancelled between admission and the first attempt
                self._release_slot(placement)
            if p.handle is not None:
                self.requests.unregister(p.handle)
            account(self.usage, p, finish, status, len(emitted), first_token_at, replica_id, ledger)
            # shielded: a second cancellation while it is written does not leave the lease unsettled
            await asyncio.shield(self.quotas.settle_request(p.req.request_id, len(p.prompt_ids), cached_tokens,
                                                            len(emitted)))

    async def _decode_text_here(self, p: Prepared, text: StreamText, emitted: list[int]) -> None:
        """From here on the router decodes the stream's text itself (see StreamText)."""
        uri = p.model.weights_uri
        try:
            tokenizer = (self.tokenizers.get(uri) if self.tokenizers.loaded(uri)
                         else await asyncio.to_thread(self.tokenizers.get, uri))
            text.decode_from(tokenizer, emitted)
        except Exception as exc:  # no tokenizer here: keep the replica's text (its ensemble, not `engine`)
            log.warning("%s keeps the replica's text (no tokenizer here: %s)", p.req.request_id, exc)

    def _finished(self, p: Prepared, reason: str, emitted: list[int], replica_id: str, cached: int) -> Finished:
        return Finished(reason, len(p.prompt_ids), cached, len(emitted), p.model.name, p.model.version, replica_id)

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

