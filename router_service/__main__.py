"""Run the router: `python -m router_service` (KServe gRPC + OpenAI/admin HTTP in one asyncio process).

Several routers on one host (`fleet up --routers N`, FLEET_ROUTERS=N) share the callers' HTTP and gRPC ports
through SO_REUSEPORT (the kernel spreads connections over them); router `--index i` has its own internal
listener (port + i: replica reports, its own /metrics) and its own usage spool.

Stopping (SIGTERM or SIGINT; docs/router.md, Stopping): the callers' listeners close, requests still queued for
a replica slot and new requests on open connections get UNAVAILABLE (503) "router is stopping, retry elsewhere"
at once, running streams get up to the grace (the longest total stream deadline, which also ends them), then
the internal listener closes and usage and traces are flushed. Whatever still runs STOP_BOUND_S after the grace
is cut by a watchdog: the process never outlives grace + STOP_BOUND_S (the pods' grace periods count on it)."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time

import uvicorn

from common import tracing
from common.logs import setup_logging
from common.report_channel import load_report_secret
from common.report_key_exchange import TokenReviewer
from common.settings import Settings, load_from_env, load_settings
from router_service.budgets import PriceBook
from router_service.core import Router
from router_service.fair_sync import FairSync, SqlFairStore
from router_service.grpc_frontend import start_grpc_server
from router_service.http_frontend import create_app
from router_service.internal_api import create_internal_app
from router_service.registry_cache import RegistryCache
from router_service.settings import RouterSettings
from usage.producer import UsageProducer

STOP_BOUND_S = 10.0  # after the grace: the last streams' bookkeeping, the internal listener, usage and trace flushes


class Server(uvicorn.Server):
    """uvicorn's server without its own signal handling: since uvicorn 0.29 `serve` installs SIGINT/SIGTERM
    handlers of its own (one server's replaces the other's), so SIGTERM stopped the internal listener at once
    and reached the other servers only as a re-raised signal when it had finished; the router's handler
    alone decides the order of its stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def parse_args(s: Settings, rs: RouterSettings) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m router_service",
                                 description="The platform's front door: authenticates callers, picks model version "
                                             "and replica, streams tokens, meters usage.")
    ap.add_argument("--host", default=s.router_host, help="listen address (default %(default)s)")
    ap.add_argument("--http-port", type=int, default=s.router_http_port, help="OpenAI/admin/metrics HTTP port")
    ap.add_argument("--grpc-port", type=int, default=s.router_grpc_port, help="KServe v2 gRPC port")
    ap.add_argument("--internal-host", default=s.router_internal_host,
                    help="address of the internal listener for replica state reports; loopback by default, the pod "
                         "address behind a NetworkPolicy in Kubernetes (FLEET_ROUTER_INTERNAL_HOST)")
    ap.add_argument("--index", type=int, default=0, choices=range(s.routers), metavar=f"0..{s.routers - 1}",
                    help="this router's place among the FLEET_ROUTERS routers sharing the callers' ports")
    ap.add_argument("--internal-port", type=int, default=None,
                    help="port of the internal listener (default FLEET_ROUTER_INTERNAL_PORT + index)")
    ap.add_argument("--db-url", default=s.db_url, help="registry database URL (FLEET_DB_URL)")
    ap.add_argument("--kafka", default=s.kafka_bootstrap, help="Kafka bootstrap servers for usage events")
    ap.add_argument("--max-waiting", type=int, default=rs.max_waiting,
                    help="admission queue bound per model version (FLEET_ROUTER_MAX_WAITING)")
    ap.add_argument("--start-wait-s", type=float, default=rs.start_wait_s,
                    help="requests for a version whose replicas are starting wait for them (up to their deadline); "
                         "a replica row still `starting` after this many seconds no longer counts "
                         "(FLEET_ROUTER_START_WAIT_S)")
    ap.add_argument("--no-usage", action="store_true", help="do not meter usage (benchmarks only)")
    args = ap.parse_args()
    if args.internal_port is None:
        args.internal_port = s.router_internal_port + args.index
    return args


def shared_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """The callers' HTTP socket; with `reuse_port`, other routers bind the same port (SO_REUSEPORT)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def register_env_admin_tokens(settings: Settings, db_url: str) -> None:
    """FLEET_ADMIN_TOKEN / FLEET_VIEWER_TOKEN (e.g. from a Kubernetes Secret) become the named tokens `admin`
    and `viewer` (stored hashed), as `fleet seed` does for the data dir's token files."""
    from sqlalchemy.exc import IntegrityError

    from registry.admin_tokens import ensure_admin_token
    from registry.db import session_scope
    for name, role, token in (("admin", "operator", settings.admin_token), ("viewer", "viewer", settings.viewer_token)):
        if not token:
            continue
        try:
            with session_scope(db_url) as s:
                ensure_admin_token(s, name, role, token)
        except IntegrityError:  # another router of the Deployment, starting at the same time, added it first
            with session_scope(db_url) as s:
                ensure_admin_token(s, name, role, token)


async def serve(args: argparse.Namespace, settings: Settings, rs: RouterSettings) -> None:
    log = setup_logging("router", settings.log_level, settings.log_format)
    tracing.configure("fleet-router", settings.otlp_endpoint, settings.trace_sample_ratio, **{
        "fleet.region": settings.region})
    register_env_admin_tokens(settings, args.db_url)
    registry = RegistryCache(args.db_url)
    spool = settings.spool_dir / ("router" if args.index == 0 else f"router-{args.index}")  # kept across restarts
    producer = None if args.no_usage else UsageProducer(args.kafka, spool, settings.usage_topic)
    if producer is not None:
        producer.start()
    router = Router(registry, producer, region=settings.region, choice=rs.choice_params(), gateway=rs.gateway(),
                    max_waiting=args.max_waiting, batch_yield=rs.batch_yielder(), start_wait_s=args.start_wait_s,
                    timeouts=rs.stream_timeouts(), healing=rs.healing(), default_max_tokens=rs.max_tokens_caps())
    router.quotas.prices = PriceBook(settings.usage_db_path)  # chargeback's prices, for budgets in money
    router.rollout_gate_percent = rs.rollout_gate_percent  # the admin API's promotion rule (docs/router.md)
    grpc_server = await start_grpc_server(router, args.host, args.grpc_port)
    # a stopping router lets open streams run up to the longest total stream deadline (the pod's grace period
    # is sized from the same number: deploy/base/router.yaml), then closes what is left
    grace_s = rs.stream_timeouts().stop_grace_s()
    config = uvicorn.Config(create_app(router), host=args.host, port=args.http_port, log_level="warning",
                            lifespan="off", timeout_graceful_shutdown=grace_s)  # type: ignore[arg-type] (a float works)
    http_server = Server(config)
    internal_server = Server(uvicorn.Config(
        create_internal_app(router, load_report_secret(settings), TokenReviewer.in_cluster()), host=args.internal_host,
        port=args.internal_port, log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(registry.watch())
    renewer = asyncio.create_task(router.quotas.renew_forever())
    warm = asyncio.create_task(asyncio.to_thread(router.warm_tokenizers))  # noqa: F841 (runs in the background)
    http_task = asyncio.create_task(http_server.serve(
        sockets=[shared_socket(args.host, args.http_port, settings.routers > 1)]))
    prices = asyncio.create_task(router.quotas.prices.refresh_forever())
    # fair shares between teams across routers (issue 37): a shared virtual clock (slow while no other router)
    fair = asyncio.create_task(
        FairSync(SqlFairStore(args.db_url), router.quotas.router_id, router.queues).run_forever())
    internal_task = asyncio.create_task(internal_server.serve())
    log.info("router %d of %d serving gRPC on %s:%d, HTTP on %s:%d, internal reports on %s:%d (registry version %d)",
             args.index, settings.routers, args.host, args.grpc_port, args.host, args.http_port, args.internal_host,
             args.internal_port, registry.snapshot.version)
    await stop.wait()
    started = time.monotonic()
    _watchdog(grace_s + STOP_BOUND_S, log)
    queued = router.begin_stop()
    log.info("router stopping: %d queued requests refused (retry elsewhere), %d running get up to %g s",
             queued, len(router.requests.handles) - queued, grace_s)
    http_server.should_exit = True
    await asyncio.gather(grpc_server.stop(grace=grace_s), http_task)  # both within the one grace period
    await _settled(router, deadline=time.monotonic() + 2.0)  # streams cut at the grace bill what they streamed
    internal_server.should_exit = True  # replica reports until the last stream ended
    await internal_task
    watcher.cancel()
    renewer.cancel()
    prices.cancel()
    fair.cancel()
    await router.close()
    if producer is not None:  # what it cannot send in time stays spooled for the next start
        producer.close(timeout_s=3.0)
    tracing.shutdown()
    log.info("router stopped after %.2f s", time.monotonic() - started)


async def _settled(router: Router, deadline: float) -> None:
    """Until the streams cancelled at the end of the grace have unwound (usage event written), or `deadline`."""
    while router.requests.handles and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _watchdog(after_s: float, log: logging.Logger) -> None:
    """Ends the process `after_s` from now whatever is still running (a daemon thread: a stuck event loop,
    thread or flush cannot hold the stop past it)."""
    def cut() -> None:
        log.error("router still stopping %.1f s after SIGTERM (grace + %g s): exiting now", after_s, STOP_BOUND_S)
        logging.shutdown()
        os._exit(1)
    timer = threading.Timer(after_s, cut)
    timer.daemon = True
    timer.start()


def main() -> None:
    settings, rs = load_settings(), load_from_env(RouterSettings)  # read once, at start; a bad value stops here
    asyncio.run(serve(parse_args(settings, rs), settings, rs))


if __name__ == "__main__":
    main()
