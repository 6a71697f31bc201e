"""Chaos with streams open, on a real router (usage metering on), three real Triton replicas, a real tansu
broker and the real loader: one replica is killed -9, another hung with SIGSTOP, the broker is paused and
the spool's filesystem (a real tmpfs) is filled up, all while six streams run. No caller may wait past its
deadline, and every token a caller received is billed exactly once. Then the router itself is killed -9
mid-stream: the next router on the same spool bills the tokens already streamed."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time

import pytest
import tritonclient.grpc.aio as grpcaio

from common.processes import free_port, stop_pid
from common.services import start_tansu
from common.settings import load_settings
from tests.integration.router_client import CHATML, stream_once
from tests.reliability.conftest import INTER_TOKEN_S, mount_tmpfs, start_fault_stack
from usage import store
from usage.loader import UsageLoader

pytestmark = pytest.mark.integration
MODEL = "smollm2-135m"
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos")
    port = free_port()
    broker = start_tansu(load_settings(), port, root / "tansu.log")  # settings: only for the vendored binary
    spool = root / "data" / "spool"
    spool.mkdir(parents=True)
    mounted = mount_tmpfs(spool, "48m").returncode == 0
    stack = None
    try:
        stack = start_fault_stack(root / "data", router_args=(), KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{port}")
        loader = UsageLoader(f"127.0.0.1:{port}", root / "usage.duckdb", topic=stack.settings.usage_topic,
                             group_id="chaos-loader", dlq_topic=stack.settings.usage_dlq_topic)
        stop = threading.Event()
        thread = threading.Thread(target=loader.run, args=(stop, 0.5), daemon=True)
        thread.start()
        yield {"stack": stack, "broker": broker, "spool": spool if mounted else None, "store": root / "usage.duckdb"}
        stop.set()
        thread.join(timeout=30)
    finally:
        if stack is not None:
            for rid in stack.replica_ids:
                try:
                    os.killpg(stack.replica_pid(rid), signal.SIGCONT)
                except (ProcessLookupError, FileNotFoundError):
                    pass
            stack.stop()
        try:
            os.kill(broker.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        stop_pid(broker.pid, grace_s=3)
        if mounted:
            subprocess.run(["umount", "-l", str(spool)], check=False)


def _billed(store_path, ids: set[str], timeout_s: float) -> dict[str, tuple[int, int]]:
    """request_id -> (rows, completion tokens) once every id has landed (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    got: dict[str, tuple[int, int]] = {}
    while time.monotonic() < deadline:
        try:  # the lake beside store_path (the control file itself may not exist yet)
            with store.connect(store_path, read_only=True, timeout_s=2) as con:
                rows = con.execute("SELECT request_id, count(*), sum(completion_tokens) FROM usage_events "
                                   "GROUP BY request_id").fetchall()
            got = {r[0]: (r[1], r[2]) for r in rows if r[0] in ids}
        except Exception:  # nothing loaded yet, or the loader holds the control file for a moment
            pass
        if set(got) == ids:
            return got
        time.sleep(0.5)
    return got


def _fill(path) -> int:
    """Fill a filesystem until ENOSPC; returns the bytes written."""
    written = 0
    with open(path / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
                written += 1 << 20
        except OSError:
            pass
    return written


def test_chaos_no_caller_waits_past_its_deadline_and_every_token_is_billed_once(chaos):
    stack, broker = chaos["stack"], chaos["broker"]
    done_chaos: list[str] = []

    async def main():
        client = grpcaio.InferenceServerClient(stack.grpc_url)
        deadline_ms = int((time.time() + DEADLINE_S) * 1000)
        progress = {"tokens": 0}
        streaming: set[int] = set()      # streams that have their first token

        async def on_token(i, so_far):
            progress["tokens"] += 1
            streaming.add(i)
            # chaos once every stream runs (has its first token) and 12 tokens went out: a stream still
            # waiting for its first token on the replica about to hang would wait out its first-token timeout
            if done_chaos or progress["tokens"] < 12 or len(streaming) < 6:
                return
            done_chaos.append("started")
            busy = sorted({r["replica_id"] for r in stack.fleet()["replicas"] if r["inflight"] > 0})
            idle = [r for r in stack.replica_ids if r not in busy]
            victims = (busy + idle)[:2]
            os.killpg(stack.replica_pid(victims[0]), signal.SIGKILL)
            os.killpg(stack.replica_pid(victims[1]), signal.SIGSTOP)
            os.kill(broker.pid, signal.SIGSTOP)  # broker down: usage waits in the spool
            if chaos["spool"] is not None:
                _fill(chaos["spool"])  # the spool's disk is full
            done_chaos.extend(victims)

        async def one(i):
            started = time.monotonic()
            out = await stream_once(client, MODEL, CHATML.format(q=f"Tell me a story about the number {i}."), 48,
                                    stack.api_key, on_token=lambda so_far: on_token(i, so_far),
                                    deadline_ms=deadline_ms)
            return out, time.time(), time.monotonic() - started
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), DEADLINE_S + 30)
        await client.close()
        return results, deadline_ms

    results, deadline_ms = asyncio.run(main())
    assert len(done_chaos) == 3, "the streams ended before the chaos began"
    os.kill(broker.pid, signal.SIGCONT)  # broker back
    if chaos["spool"] is not None:
        (chaos["spool"] / "filler").unlink()
    for out, ended_at, took in results:
        assert ended_at * 1000 <= deadline_ms + 1000, (took, out.error_message)  # nobody waited past the deadline
        assert out.error is None or "ABORTED" in out.error_message or "DEADLINE" in (out.error or ""), out.error_message
    received = {out.response_id: len(out.ids) for out, _, _ in results}
    assert all(received) and len(received) == 6
    billed = _billed(chaos["store"], set(received), 60)
    assert set(billed) == set(received), (billed, received)
    for rid, n in received.items():
        rows, tokens = billed[rid]
        assert rows == 1 and tokens == n, (rid, rows, tokens, n)  # billed exactly once, every token
    os.killpg(stack.replica_pid(done_chaos[2]), signal.SIGCONT)


def test_router_killed_mid_stream_bills_the_tokens_already_streamed(chaos):
    stack = chaos["stack"]
    killed = []

    async def main():
        client = grpcaio.InferenceServerClient(stack.grpc_url)

        async def on_token(so_far):
            if not killed and len(so_far.ids) >= 10:
                os.kill(stack.router.pid, signal.SIGKILL)
                killed.append(len(so_far.ids))
        out = await stream_once(client, MODEL, CHATML.format(q="Write a long essay about rivers."), 200,
                                stack.api_key, on_token=on_token)
        await client.close()
        return out
    out = asyncio.run(main())
    assert killed and out.error is not None  # the router died under the caller
    received = len(out.ids)
    stack.router.wait()
    stack.start_router(())  # a new router on the same spool
    billed = _billed(chaos["store"], {out.response_id}, 60)
    assert out.response_id in billed, "the dead router's stream was never billed"
    rows, tokens = billed[out.response_id]
    # every token the caller received is billed, once; tokens the router took from the replica just before
    # it died (and that never reached the caller) are billed too: they were generated
    assert rows == 1 and received <= tokens <= received + 8, (received, tokens)
