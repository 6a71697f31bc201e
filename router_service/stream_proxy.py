"""One request's stream through the router: proxy the replica's tokens to the caller, resume on another
replica from prompt + emitted ids when one dies or hangs (at most MAX_ATTEMPTS tries, never on a third replica
after two died serving it), re-queue a batch stream preempted for interactive work, end at the request's total
deadline, and account for it once (usage event, quota settlement) whatever happens.

`Router.stream` (router_service/core.py) returns `proxy_stream(router, p)` for a request `prepare` admitted.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from router_service import metrics, tracing
from router_service.accounting import account, open_ledger_entry
from router_service.errors import RouterError
from router_service.request import Finished, Prepared, TokenDelta
from router_service.stream_guard import DeadlineReached, ReplicaHung, StreamText, guarded
from router_service.stream_judge import StreamJudge
from router_service.upstream import Preempted, ReplicaFailed, ReplicaRefused

if TYPE_CHECKING:
    from router_service.core import Router

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
# A request whose stream was running on two replicas when each died or hung is not tried on a third:
# it may be what kills them (a poison request), and each try would take another replica down.
MAX_REPLICA_KILLS = 2


async def proxy_stream(router: Router, p: Prepared) -> AsyncIterator[TokenDelta | Finished]:
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
    end = router.timeouts.total_deadline(req.tier, p.arrived, req.deadline_ms)
    end_ms, end_reason = end.end_ms, end.reason
    ledger = open_ledger_entry(router.usage, p)
    if req.tier == "interactive":
        router.batch_yield.interactive_started(key)
    try:
        while True:
            if p.handle is not None and p.handle.cancelled:
                finish = _finished(p, "cancelled", emitted, replica_id, cached_tokens)
                break
            if placement is None:
                try:
                    placement = await router.admit(p, failed, p.prompt_ids + emitted, req.max_tokens - len(emitted))
                except RouterError as exc:
                    if exc.code not in ("deadline_exceeded", "cancelled"):
                        raise
                    finish = _finished(p, end_reason if exc.code == "deadline_exceeded" else "cancelled",
                                            emitted, replica_id, cached_tokens)
                    break
            replica_id = placement.replica.replica_id
            attempt_started, prefill_pending, attempt_error, judge = time.monotonic(), True, None, None
            attempt_span, req.trace_context = tracing.start_attempt(replica_id, failures + 1, len(emitted))
            if first_token_at is None and not failures:
                metrics.DISPATCH.labels(req.model, req.tier).observe(attempt_started - p.arrived)
            if req.tier == "batch" and p.handle is not None:
                p.handle.preempted = False
                router.batch_yield.batch_started(key, p.handle)
            try:
                client = router.client_for(placement.replica)
                direct = await client.serves_engine()
                if emitted or direct:  # a resume, or a replica that streams ids only: the router decodes
                    await _decode_text_here(router, p, text, emitted)
                upstream = client.generate(
                    req, p.prompt_ids + emitted, req.max_tokens - len(emitted), p.handle,
                    # seeded and guided streams continue from the emitted ids (random stream, grammar state)
                    seed_offset=len(emitted) if req.seed is not None or req.guided else 0,
                    direct=direct and text.decoding)
                judge = StreamJudge(router.replica_state, router.replicas, router.healing, p.model, req.request_id,
                                    replica_id)
                async with aclosing(guarded(upstream, router.timeouts.first_token_s[req.tier],
                                            router.timeouts.inter_token_s[req.tier], end_ms,
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
                                router.chooser.progress(placement, placement.load - (req.max_tokens - len(emitted)))
                            router.chooser.progress(placement, len(item.token_ids))
                            emitted.extend(item.token_ids)
                            if ledger is not None:
                                ledger.progress(len(emitted))
                            yield text.delta(item)
                        else:
                            tail = text.tail()
                            if tail:
                                yield TokenDelta(tail, [])
                            cached_tokens = item.cached_prompt_tokens if not cached_tokens else cached_tokens
                            finish = _finished(p, item.finish_reason, emitted, replica_id, cached_tokens)
                break
            except DeadlineReached:
                log.info("%s of %s passed while waiting on replica %s (%d tokens streamed)", end_reason,
                         req.request_id, replica_id, len(emitted))
                finish = _finished(p, end_reason, emitted, replica_id, cached_tokens)
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
                    if router.replicas.is_last(p.model, replica_id):
                        # never cordoned on timeouts alone: it stays suspect and probed; nothing else serves
                        router.replicas.suspect_replica(replica_id, f"stream of {req.request_id}: {exc}")
                        raise RouterError("unavailable", f"replica {replica_id}, the only one serving "
                                          f"{p.model.name} version {p.model.version}, stopped responding ({exc}; "
                                          f"no state report either); {len(emitted)} tokens were streamed and are "
                                          f"billed; it is being probed and serves again once it answers",
                                          retry_after_ms=int(router.healing.probe.max_interval_s * 1000)) from exc
                if not exc.alive:  # a replica that answers with an error stays in service
                    kills.append(replica_id)
                    router.cordon(replica_id, f"stream of {req.request_id} broke: {exc}")
                if end_ms <= time.time() * 1000:
                    log.info("not retrying %s: its %s has passed", req.request_id, end_reason)
                    finish = _finished(p, end_reason, emitted, replica_id, cached_tokens)
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
                    router.batch_yield.batch_ended(key, p.handle)
                router.release_slot(placement, p.model, time.monotonic() - attempt_started)
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
            router.batch_yield.interactive_ended(key)
        if placement is not None:  # cancelled between admission and the first attempt
            router.release_slot(placement)
        if p.handle is not None:
            router.requests.unregister(p.handle)
        account(router.usage, p, finish, status, len(emitted), first_token_at, replica_id, ledger)
        # shielded: a second cancellation while it is written does not leave the lease unsettled
        await asyncio.shield(router.quotas.settle_request(p.req.request_id, len(p.prompt_ids), cached_tokens,
                                                        len(emitted)))

async def _decode_text_here(router: Router, p: Prepared, text: StreamText, emitted: list[int]) -> None:
    """From here on the router decodes the stream's text itself (see StreamText)."""
    uri = p.model.weights_uri
    try:
        tokenizer = (router.tokenizers.get(uri) if router.tokenizers.loaded(uri)
                     else await asyncio.to_thread(router.tokenizers.get, uri))
        text.decode_from(tokenizer, emitted)
    except Exception as exc:  # no tokenizer here: keep the replica's text (its ensemble, not `engine`)
        log.warning("%s keeps the replica's text (no tokenizer here: %s)", p.req.request_id, exc)

def _finished(p: Prepared, reason: str, emitted: list[int], replica_id: str, cached: int) -> Finished:
    return Finished(reason, len(p.prompt_ids), cached, len(emitted), p.model.name, p.model.version, replica_id)
