"""The router's request path: authenticate, resolve model/version/adapter, tokenise, pick a replica,
proxy the stream (resuming on another replica if one dies), and emit one usage event per request.

Frontends (gRPC, HTTP) call `authenticate`, then `prepare` (all caller errors are raised here, before
any byte is streamed), then iterate `stream`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from router_service import metrics
from router_service.errors import RouterError
from router_service.registry_cache import CallerInfo, ModelInfo, RegistryCache, ReplicaInfo
from router_service.replica_state import ReplicaStateTable
from router_service.request import TIERS, Finished, GenerateRequest, TokenDelta
from router_service.rollout import pick_version
from router_service.tokenization import TokenizerCache
from router_service.upstream import ReplicaClient, ReplicaFailed
from usage.events import UsageEvent

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3


@dataclass
class Prepared:
    req: GenerateRequest
    caller: CallerInfo
    model: ModelInfo
    prompt_ids: list[int]
    arrived: float = field(default_factory=time.monotonic)


class Router:
    def __init__(self, registry: RegistryCache, usage_producer=None, region: str = "local") -> None:
        self.registry = registry
        self.usage = usage_producer
        self.region = region
        self.tokenizers = TokenizerCache()
        self.clients: dict[str, ReplicaClient] = {}
        self.inflight: dict[str, int] = {}
        self.cordoned: set[str] = set()
        self.replica_state = ReplicaStateTable()

    # --- gateway -----------------------------------------------------------------------------------
    def authenticate(self, api_key: str | None) -> CallerInfo:
        if not api_key:
            raise RouterError("unauthenticated", "missing API key: send 'authorization: Bearer <key>'")
        caller = self.registry.caller_for_key(api_key)
        if caller is None:
            raise RouterError("unauthenticated", "unknown API key")
        return caller

    # --- resolution --------------------------------------------------------------------------------
    def resolve_model(self, caller: CallerInfo, req: GenerateRequest) -> ModelInfo:
        snap = self.registry.snapshot
        versions = snap.models.get(req.model)
        if not versions:
            known = ", ".join(sorted(snap.models)) or "none"
            raise RouterError("not_found", f"model {req.model!r} is not served; known models: {known}")
        if caller.allowed_models and req.model not in caller.allowed_models:
            raise RouterError("permission_denied", f"caller {caller.name!r} may not use model {req.model!r}")
        if TIERS.index(req.tier) < TIERS.index(caller.max_tier):
            raise RouterError("permission_denied",
                              f"priority {req.tier!r} is above caller {caller.name!r}'s maximum tier {caller.max_tier!r}")
        if req.version:
            if req.version not in versions:
                raise RouterError("not_found", f"model {req.model!r} has no version {req.version!r}; "
                                               f"known versions: {', '.join(sorted(versions))}")
            version = req.version
        else:
            split = snap.routes.get(req.model)
            if not split:
                raise RouterError("unavailable", f"model {req.model!r} has no route; an operator must set one")
            version = pick_version(split, req.session or caller.name)
        if req.adapter:
            adapter = snap.adapters.get(req.adapter)
            if adapter is None or adapter.base_model != req.model:
                known = sorted(a.name for a in snap.adapters.values() if a.base_model == req.model)
                raise RouterError("not_found", f"adapter {req.adapter!r} does not exist for model {req.model!r}; "
                                               f"known adapters: {', '.join(known) or 'none'}")
            if adapter.owner_team != caller.team and req.adapter not in caller.allowed_adapters:
                raise RouterError("permission_denied", f"adapter {req.adapter!r} belongs to team {adapter.owner_team!r}")
        return versions[version]

    async def prepare(self, caller: CallerInfo, req: GenerateRequest) -> Prepared:
        try:
            model = self.resolve_model(caller, req)
            req.validate(model.max_context)
            if req.deadline_ms is not None and req.deadline_ms <= time.time() * 1000:
                raise RouterError("deadline_exceeded", f"deadline_ms {req.deadline_ms} has already passed")
            if req.prompt_ids is None:
                if req.chat_messages is not None:
                    ids = await asyncio.to_thread(self.tokenizers.encode_chat, model.weights_uri, req.chat_messages)
                else:
                    ids = await asyncio.to_thread(self.tokenizers.encode, model.weights_uri, req.prompt_text or "")
                req.prompt_ids = ids
            req.check_prompt_fits(model.max_context)
        except RouterError as exc:
            metrics.REJECTED.labels(exc.code).inc()
            raise
        return Prepared(req, caller, model, list(req.prompt_ids))

    # --- replicas ------------------------------------------------------------------------------------
    def choose_replica(self, model: ModelInfo, exclude: set[str]) -> ReplicaInfo:
        candidates = [r for r in self.registry.snapshot.replicas
                      if r.model == model.name and r.version == model.version and r.state == "serving"
                      and r.replica_id not in self.cordoned and r.replica_id not in exclude]
        if not candidates:
            raise RouterError("unavailable", f"no serving replica for {model.name} version {model.version}",
                              retry_after_ms=1000)
        return min(candidates, key=lambda r: self.inflight.get(r.replica_id, 0))

    def client_for(self, replica: ReplicaInfo) -> ReplicaClient:
        client = self.clients.get(replica.replica_id)
        if client is None:
            client = self.clients[replica.replica_id] = ReplicaClient(replica.replica_id, replica.grpc_url)
        return client

    # --- streaming -----------------------------------------------------------------------------------
    async def stream(self, p: Prepared) -> AsyncIterator[TokenDelta | Finished]:
        """Proxy the generation; resumes on another replica from prompt + emitted ids if one fails."""
        req, emitted = p.req, []
        tried: set[str] = set()
        first_token_at: float | None = None
        finish: Finished | None = None
        replica_id, status = "", "error"
        try:
            for attempt in range(MAX_ATTEMPTS):
                replica = self.choose_replica(p.model, tried)
                replica_id = replica.replica_id
                tried.add(replica_id)
                self.inflight[replica_id] = self.inflight.get(replica_id, 0) + 1
                metrics.INFLIGHT.labels(replica_id).set(self.inflight[replica_id])
                try:
                    async for item in self.client_for(replica).generate(
                            req, p.prompt_ids + emitted, req.max_tokens - len(emitted)):
                        if isinstance(item, TokenDelta):
                            if first_token_at is None:
                                first_token_at = time.monotonic()
                                metrics.TTFT.labels(req.model, req.tier).observe(first_token_at - p.arrived)
                            emitted.extend(item.token_ids)
                            yield item
                        else:
                            finish = Finished(item.finish_reason, len(p.prompt_ids), item.cached_prompt_tokens,
                                              len(emitted), p.model.name, p.model.version, replica_id)
                    break
                except ReplicaFailed as exc:
                    log.warning("replica %s failed during %s (attempt %d): %s", replica_id, req.request_id,
                                attempt + 1, exc)
                    self.cordoned.add(replica_id)
                    if req.deadline_ms is not None and req.deadline_ms <= time.time() * 1000:
                        finish = Finished("deadline", len(p.prompt_ids), 0, len(emitted), p.model.name,
                                          p.model.version, replica_id)
                        break
                    if attempt + 1 == MAX_ATTEMPTS:
                        raise RouterError("unavailable", f"request failed on {MAX_ATTEMPTS} replicas: {exc}")
                    metrics.RESUMES.labels(req.model).inc()
                finally:
                    self.inflight[replica_id] -= 1
                    metrics.INFLIGHT.labels(replica_id).set(self.inflight[replica_id])
            status = "ok"
            if finish is not None:
                yield finish
        except (asyncio.CancelledError, GeneratorExit):
            status = "cancelled"
            raise
        finally:
            self._account(p, finish, status, emitted, first_token_at, replica_id)

    def _account(self, p: Prepared, finish: Finished | None, status: str, emitted: list[int],
                 first_token_at: float | None, replica_id: str) -> None:
        req = p.req
        reason = finish.finish_reason if finish else ("cancelled" if status == "cancelled" else "error")
        if status == "ok" and reason == "cancelled":
            status = "cancelled"
        metrics.REQUESTS.labels(req.model, req.tier, status).inc()
        metrics.TOKENS.labels(req.model, req.tier).inc(len(emitted))
        metrics.PROMPT_TOKENS.labels(req.model, req.tier).inc(len(p.prompt_ids))
        if self.usage is None:
            return
        now = time.monotonic()
        event = UsageEvent(
            request_id=req.request_id, ts=time.time(), caller=p.caller.name, team=p.caller.team,
            model=p.model.name, version=p.model.version, adapter=req.adapter, priority=req.tier,
            region=self.region, replica_id=replica_id, prompt_tokens=len(p.prompt_ids),
            cached_prompt_tokens=finish.cached_prompt_tokens if finish else 0, completion_tokens=len(emitted),
            ttft_ms=round((first_token_at - p.arrived) * 1000, 3) if first_token_at else 0.0,
            duration_ms=round((now - p.arrived) * 1000, 3), finish_reason=reason, status=status)
        try:
            self.usage.emit(event)
        except Exception:  # metering must never break serving; the spool write failing is logged loudly
            log.exception("could not spool usage event for %s", req.request_id)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()
