"""Game-day checks for the usage pipeline: real broker, real processes, real kills.

Each scenario runs a steady stream of usage events (a "router" emitting through `UsageProducer`), injects
one fault, then drains and counts what reached the store:
- `broker_outage`: the broker is unreachable for `outage_s` (mode "pause": SIGSTOP/SIGCONT, the broker
  keeps its log; mode "restart": killed and restarted on the same port, which for the in-memory tansu
  broker means an empty log).
- `loader_kill`: the loader runs as its own process and is SIGKILLed repeatedly mid-batch.
- `router_kill`: the emitting process is SIGKILLed with events in its spool, then restarted.
- `loader_rebalance`: two loader processes; one is killed between its lake write and its offset commit and
  the other takes its partitions over.
Each returns a dict with the counts (emitted, stored, missing, duplicates) and timings. Used by
tests/usage (short outages) and bench/usage/faults.py (the 30 s outage of the issue).
`python -m usage.faultcheck emit ...` is the emitting child process of `router_kill`.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

from common.processes import free_port, stop_pid
from common.services import start_tansu
from common.settings import Settings
from usage import store
from usage.events import UsageEvent
from usage.producer import UsageProducer


def source_tokens(request_id: str) -> int:
    """The completion tokens the source billed for this id (varies per id, so a double count shows in the sum)."""
    return 1 + zlib.crc32(request_id.encode()) % 200


def make_event(request_id: str, caller: str = "bench-caller", team: str = "bench-team") -> UsageEvent:
    return UsageEvent(request_id=request_id, ts=time.time(), caller=caller, team=team, model="smollm2-135m",
                      version="1", priority="interactive", replica_id="replica-0", prompt_tokens=512,
                      cached_prompt_tokens=128, completion_tokens=source_tokens(request_id), ttft_ms=42.0,
                      duration_ms=900.0,
                      finish_reason="stop", status="ok")


class Broker:
    """A tansu broker on a fixed port that can be paused, killed and restarted."""

    def __init__(self, settings: Settings, work_dir: Path) -> None:
        self.settings, self.port, self.log = settings, free_port(), work_dir / "tansu.log"
        self.proc = start_tansu(settings, self.port, self.log)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        self.proc = start_tansu(self.settings, self.port, self.log)

    def stop(self) -> None:
        try:
            self.resume()
        except ProcessLookupError:
            pass
        stop_pid(self.proc.pid, grace_s=3)


class Emitter:
    """A steady request load: `rate` events/s through a UsageProducer, ids prefix-0, prefix-1, ..."""

    def __init__(self, producer: UsageProducer, prefix: str, rate: float) -> None:
        self.producer, self.prefix, self.rate = producer, prefix, rate
        self.count = 0
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Emitter:
        self._thread.start()
        return self

    def _run(self) -> None:
        start = time.perf_counter()
        while not self._stop.is_set():
            ev = make_event(f"{self.prefix}-{self.count}", caller=f"caller-{self.count % 7}")
            t0 = time.perf_counter()
            self.producer.emit(ev)
            self.latencies.append(time.perf_counter() - t0)
            self.count += 1
            ahead = start + self.count / self.rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.count


def loader_cmd(bootstrap: str, store_path: Path, topic: str, group: str, writer_id: str = "") -> list[str]:
    return [sys.executable, "-m", "usage.loader_cli", "--bootstrap", bootstrap, "--store", str(store_path),
            "--topic", topic, "--dlq-topic", f"{topic}.dlq", "--group", group, "--no-check-callers",
            "--writer-id", writer_id]


def start_loader(bootstrap: str, store_path: Path, topic: str, group: str, log: Path,
                 fault: str | None = None, writer_id: str = "") -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("FLEET_USAGE_FAULT", None)
    if fault:
        env["FLEET_USAGE_FAULT"] = fault
    return subprocess.Popen(loader_cmd(bootstrap, store_path, topic, group, writer_id), env=env, stdin=subprocess.DEVNULL,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def stored_ids(store_path: Path, prefix: str) -> tuple[int, set[str]]:
    """(rows, distinct request_ids) with this prefix in the store."""
    rows, ids, _ = stored_usage(store_path, prefix)
    return rows, ids


def stored_usage(store_path: Path, prefix: str) -> tuple[int, set[str], int]:
    """(rows, distinct request_ids, billed completion tokens) with this prefix in the store."""
    with store.connect(store_path, read_only=True) as con:  # no control file yet: the lake alone
        got = con.execute("SELECT request_id, completion_tokens FROM usage_events WHERE request_id LIKE ?",
                          [prefix + "-%"]).fetchall()
    return len(got), {r[0] for r in got}, sum(r[1] for r in got)


def wait_stored(store_path: Path, prefix: str, expected: int, timeout_s: float) -> tuple[int, set[str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows, ids = stored_ids(store_path, prefix)
        if len(ids) >= expected or time.monotonic() > deadline:
            return rows, ids
        time.sleep(0.5)


def _result(name: str, emitted_ids: set[str], store_path: Path, prefix: str, sources: set[str] | None = None,
            **extra) -> dict:
    """Counts from the source: every stored row must match one distinct emitted event (`duplicates` counts
    rows beyond that), and the billed tokens must equal what the source billed for those events
    (`overbilled_tokens`), so a double count shows even where the table's key would hide a repeated row."""
    sources = emitted_ids if sources is None else sources  # ids that may legitimately be stored
    rows, ids, billed = stored_usage(store_path, prefix)
    rollup_requests, rollup_decode = rollup_totals(store_path)
    missing = emitted_ids - ids
    matched = ids & sources
    return {"scenario": name, "emitted": len(emitted_ids), "stored_rows": rows, "stored_distinct": len(ids),
            "missing": len(missing), "duplicates": rows - len(matched), "unexpected": len(ids - sources),
            "billed_tokens": billed, "overbilled_tokens": billed - sum(source_tokens(i) for i in matched),
            "rollup_requests_off": rollup_requests - rows, "rollup_tokens_off": rollup_decode - billed,
            "missing_sample": sorted(missing)[:5], **extra}


def rollup_totals(store_path: Path) -> tuple[int, int]:
    """(requests, decode tokens) in the store's rollups: must equal the raw rows' count and tokens, whatever
    crashed between the events commit and the rollups commit."""
    with store.connect(store_path, read_only=True) as con:
        req, dec = con.execute("SELECT coalesce(sum(requests), 0), coalesce(sum(decode_tokens), 0) "
                               "FROM usage_rollups").fetchall()[0]
    return int(req), int(dec)


def broker_outage(settings: Settings, work_dir: Path, outage_s: float, mode: str = "pause",
                  rate: float = 200.0, warmup_s: float = 3.0, drain_timeout_s: float = 120.0) -> dict:
    """Steady load; broker unreachable for outage_s; count. The loader runs in a thread of this process."""
    from usage.loader import UsageLoader
    broker = Broker(settings, work_dir)
    topic, prefix = f"usage-outage-{mode}-{os.getpid()}", f"outage-{mode}"
    store_path = work_dir / f"outage-{mode}.duckdb"
    producer = UsageProducer(broker.bootstrap, work_dir / f"spool-outage-{mode}", topic=topic).start()
    loader = UsageLoader(broker.bootstrap, store_path, topic=topic, group_id=f"g-{topic}", dlq_topic=topic + ".dlq")
    stop = threading.Event()
    loader_thread = threading.Thread(target=loader.run, args=(stop, 0.5), daemon=True)
    loader_thread.start()
    emitter = Emitter(producer, prefix, rate).start()
    try:
        wait_stored(store_path, prefix, 1, 60)  # the loader has joined its group and is keeping up
        time.sleep(warmup_s)
        at_stop = {"emitted": emitter.count, "pending": producer.pending(),
                   "stored": len(stored_ids(store_path, prefix)[1])}
        if mode == "pause":
            broker.pause()
        else:
            broker.kill()
        time.sleep(outage_s)
        spooled_peak = producer.pending()
        t_back = time.monotonic()
        if mode == "pause":
            broker.resume()
        else:
            broker.restart()
        time.sleep(warmup_s)
        emitted = emitter.stop()
        drained = producer.flush(drain_timeout_s)
        t_drained = time.monotonic() - t_back
        _, ids = wait_stored(store_path, prefix, emitted, drain_timeout_s)
        emitted_ids = {f"{prefix}-{i}" for i in range(emitted)}
        # Were any lost, they would be events the in-memory broker acknowledged before the stop and the loader
        # had not read (the producer's replay window exists to cover exactly those).
        lost_ok = {f"{prefix}-{i}" for i in range(at_stop["emitted"])} if mode == "restart" else set()
        return _result(f"broker_outage_{mode}", emitted_ids, store_path, prefix, outage_s=outage_s, rate=rate,
                       at_stop=at_stop, spooled_peak=spooled_peak, flushed=drained,
                       drain_after_outage_s=round(t_drained, 2), replayed=producer.replayed,
                       missing_from_before_stop=len((emitted_ids - ids) & lost_ok),
                       missing_unexplained=len((emitted_ids - ids) - lost_ok),
                       emit_p99_ms=_p99_ms(emitter.latencies))
    finally:
        emitter._stop.set()
        stop.set()
        loader_thread.join(timeout=30)
        producer.close(timeout_s=1)
        broker.stop()


def loader_kill(settings: Settings, work_dir: Path, kills: int = 3, interval_s: float = 3.0,
                rate: float = 2000.0, drain_timeout_s: float = 120.0) -> dict:
    """Steady load into a loader process that is killed at chosen points (inside the store transaction;
    after it but before the offset commit), then `kills` times at a random moment, restarting it each time."""
    broker = Broker(settings, work_dir)
    topic, prefix = f"usage-lkill-{os.getpid()}", "lkill"
    store_path, log = work_dir / "lkill.duckdb", work_dir / "loader.log"
    producer = UsageProducer(broker.bootstrap, work_dir / "spool-lkill", topic=topic).start()
    emitter = Emitter(producer, prefix, rate).start()
    group = f"g-{topic}"
    killed = 0
    try:
        for fault in ("mid_write", "after_write"):  # deterministic crash points first
            proc = start_loader(broker.bootstrap, store_path, topic, group, log, fault=fault)
            proc.wait(timeout=60)
            killed += 1
        for _ in range(kills):
            proc = start_loader(broker.bootstrap, store_path, topic, group, log)
            time.sleep(interval_s)
            proc.kill()  # lands wherever the loader is: polling, validating, writing, committing
            proc.wait()
            killed += 1
        emitted = emitter.stop()
        producer.flush(drain_timeout_s)
        proc = start_loader(broker.bootstrap, store_path, topic, group, log)
        wait_stored(store_path, prefix, emitted, drain_timeout_s)
        proc.terminate()
        proc.wait(timeout=30)
        return _result("loader_kill", {f"{prefix}-{i}" for i in range(emitted)}, store_path, prefix, kills=killed, rate=rate)
    finally:
        emitter._stop.set()
        producer.close(timeout_s=1)
        broker.stop()


def loader_rebalance(settings: Settings, work_dir: Path, before: int = 2000, after: int = 2000,
                     timeout_s: float = 90.0) -> dict:
    """Two loader processes in one group. B loads alone first (its window is seeded then); A joins and takes
    half the partitions, writes its first batch and is killed before committing its offsets (after_write);
    B is given A's partitions and re-reads that batch: it must recognise every event A stored."""
    broker = Broker(settings, work_dir)
    topic, prefix = f"usage-rebal-{os.getpid()}", "rebal"
    store_path, group = work_dir / "rebal.duckdb", f"g-usage-rebal-{os.getpid()}"
    producer = UsageProducer(broker.bootstrap, work_dir / "spool-rebal", topic=topic).start()
    procs: list[subprocess.Popen] = []

    def emit(lo: int, hi: int) -> None:
        for i in range(lo, hi):  # 64 callers (the message key) spread over every partition
            producer.emit(make_event(f"{prefix}-{i}", caller=f"caller-{i % 64}"))
        producer.flush(30)

    try:
        procs.append(start_loader(broker.bootstrap, store_path, topic, group, work_dir / "loader-b.log", writer_id="b"))
        emit(0, before)
        wait_stored(store_path, prefix, before, timeout_s)
        log_a = work_dir / "loader-a.log"
        procs.append(start_loader(broker.bootstrap, store_path, topic, group, log_a, fault="after_write",
                                  writer_id="a"))
        _wait_for_line(log_a, "partitions assigned", timeout_s)
        emit(before, before + after)
        a_exit = procs[1].wait(timeout=timeout_s)  # killed by its fault right after its first write
        _wait_committed(broker.bootstrap, group, topic, timeout_s)  # B has taken over and caught up
        return _result("loader_rebalance", {f"{prefix}-{i}" for i in range(before + after)}, store_path, prefix,
                       a_exit=a_exit, a_rows=_rows_by(store_path, "a"))
    finally:
        for proc in procs:  # not process-group leaders: stop them by their own pid
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        producer.close(timeout_s=1)
        broker.stop()


def _wait_for_line(log: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (log.read_text(errors="replace") if log.exists() else ""):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{log} has no line with {text!r} after {timeout_s:.0f} s")
        time.sleep(0.2)


def _wait_committed(bootstrap: str, group: str, topic: str, timeout_s: float) -> None:
    """Until the group's committed offsets reach the end of every partition of the topic."""
    from kafka import KafkaAdminClient, KafkaConsumer
    from kafka.structs import TopicPartition
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, client_id="faultcheck-admin")
    probe = KafkaConsumer(bootstrap_servers=bootstrap, client_id="faultcheck-probe")
    try:
        parts = [TopicPartition(topic, p) for p in sorted(probe.partitions_for_topic(topic) or ())]
        deadline = time.monotonic() + timeout_s
        while True:
            ends = probe.end_offsets(parts)
            done = admin.list_group_offsets({group: parts}).get(group, {})
            if all(done.get(tp) is not None and done[tp].offset >= ends[tp] for tp in parts):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {group} did not catch up: {done} of {ends}")
            time.sleep(0.5)
    finally:
        probe.close()
        admin.close()


def _rows_by(store_path: Path, writer: str) -> int:
    with store.connect(store_path, read_only=True) as con:
        return con.execute("SELECT count(*) FROM usage_events WHERE load_writer = ?", [writer]).fetchall()[0][0]


def router_kill(settings: Settings, work_dir: Path, rate: float = 2000.0, run_s: float = 3.0,
                broker_down: bool = True, drain_timeout_s: float = 120.0) -> dict:
    """A 'router' process emits; it is SIGKILLed (with the broker down, so its spool is full); a new router
    process on the same spool resends everything."""
    from usage.loader import UsageLoader
    broker = Broker(settings, work_dir)
    topic, prefix = f"usage-rkill-{os.getpid()}", "rkill"
    spool, store_path = work_dir / "spool-rkill", work_dir / "rkill.duckdb"
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: the router's broker is "down"
    child = subprocess.Popen([sys.executable, "-m", "usage.faultcheck", "emit", "--bootstrap",
                              dead if broker_down else broker.bootstrap, "--spool", str(spool), "--topic", topic,
                              "--prefix", prefix, "--rate", str(rate)], stdout=subprocess.PIPE, text=True)
    progress = [0]  # emits that had returned when last reported

    def follow() -> None:
        for line in child.stdout:
            progress[0] = int(line)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while progress[0] == 0 and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.05)  # the child is importing and starting
    time.sleep(run_s)
    child.kill()
    child.wait()
    reader.join(timeout=5)
    confirmed = progress[0]
    restarted = UsageProducer(broker.bootstrap, spool, topic=topic)
    spooled_at_restart = restarted.pending()
    restarted.start()
    flushed = restarted.flush(drain_timeout_s)
    restarted.close()
    loader = UsageLoader(broker.bootstrap, store_path, topic=topic, group_id=f"g-{topic}", dlq_topic=topic + ".dlq")
    deadline = time.monotonic() + drain_timeout_s
    try:
        while time.monotonic() < deadline and len(stored_ids(store_path, prefix)[1]) < confirmed:
            loader.run_once(1.0)
        for _ in range(3):  # pick up events spooled after the last progress report
            loader.run_once(1.0)
    finally:
        loader.close()
        broker.stop()
    must = {f"{prefix}-{i}" for i in range(confirmed)}
    # Up to 100 emits may have returned after the last progress line: they may land too, nothing beyond.
    possible = {f"{prefix}-{i}" for i in range(confirmed + 100)}
    return _result("router_kill", must, store_path, prefix, sources=possible, spooled_at_restart=spooled_at_restart, flushed=flushed,
                   broker_down_before_kill=broker_down)


def _p99_ms(lat: list[float]) -> float:
    if not lat:
        return 0.0
    s = sorted(lat)
    return round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1000, 4)


def _emit_main(args: argparse.Namespace) -> int:
    producer = UsageProducer(args.bootstrap, Path(args.spool), topic=args.topic).start()
    i = 0
    start = time.perf_counter()
    while True:
        producer.emit(make_event(f"{args.prefix}-{i}", caller=f"caller-{i % 7}"))
        i += 1
        if i % 100 == 0:
            print(i, flush=True)  # "the first i emits have returned"
        ahead = start + i / args.rate - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m usage.faultcheck", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    emit = sub.add_parser("emit", help="emit events forever through a UsageProducer (the router_kill child)")
    emit.add_argument("--bootstrap", required=True)
    emit.add_argument("--spool", required=True)
    emit.add_argument("--topic", required=True)
    emit.add_argument("--prefix", required=True)
    emit.add_argument("--rate", type=float, default=1000.0)
    raise SystemExit(_emit_main(parser.parse_args()))
