"""Usage loader: Kafka consumer group -> validated, de-duplicated rows in the usage lake (usage/lake.py).

One batch = poll (up to `batch_max` records or `max_wait_s`) -> validate -> drop request_ids stored in the
de-duplication window (usage/dedup.py) -> three Delta commits: the events (day-partitioned), their hourly
rollups, the rejects -> dead-letter sends flushed -> Kafka offsets committed.
`run()` pipelines: the next batch is polled and validated while the previous one is being written.

Exactly once without a primary key:
- Each loader process is a writer with a stable id (`--writer-id`, default the group id) and numbers its
  batches; the events commit carries the application transaction (`events:<writer>`, seq) and the rollups
  commit (`rollups:<writer>`, seq), each in the same atomic Delta commit as the data it describes.
- On start (and after any store error) the loader recovers: if the events table holds a batch the rollups
  table lacks (killed between the two commits), that batch's rollup is rebuilt from its stored events and
  committed; then the window is re-seeded from the events and rejects loaded in the last window.
- Offsets are committed to Kafka only after the writes, so a crash re-delivers at most the last two
  batches, and the window turns that redelivery (and any producer resend) into no-ops.
- Several workers: when partitions move, the old owner's writes land first and the new owner re-seeds its
  window from the lake (usage/rebalance.py), so a batch written but not acknowledged by the old owner is
  recognised by the new one.

Bad events (invalid JSON, schema violations, negative tokens, cached > prompt tokens, a ts or count the
store cannot hold, unknown caller when a caller set is given, or anything else the store refuses) go to the
dead-letter topic with the reason, are recorded in `usage_rejects` and counted in `stats`, and never stop
the loader.

Run: `fleet usage load` or `python -m usage.loader_cli --help` (usage/loader_cli.py).
"""
from __future__ import annotations

import json
import logging
import math
import operator
import os
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
from kafka.structs import OffsetAndMetadata, TopicPartition
from pydantic import ValidationError

from usage import lake as lake_mod
from usage import loader_metrics, recovery, retention, rollups, store
from usage.dedup import DEFAULT_WINDOW_S, RecentIds
from usage.events import UsageEvent
from usage.kafka_io import close_producer, ensure_topics, make_consumer, make_producer
from usage.rebalance import InFlight, Rebalance

log = logging.getLogger(__name__)

MAX_TS = 253402300800.0  # 10000-01-01: the store keeps `day` as a DATE and ts * 1000 as a BIGINT
MAX_TOKENS = 1 << 62
CALLER_REFRESH_S = 30.0
CALLER_MISS_REFRESH_S = 5.0  # a caller created a moment ago: refresh early rather than reject it


def registry_callers(db_url: str) -> Callable[[], set[str]]:
    """Known callers from the model registry (for `known_callers`)."""
    def load() -> set[str]:
        from registry.db import session_scope
        from registry.queries import list_callers
        with session_scope(db_url) as session:
            return {c.name for c in list_callers(session)}
    return load


_row = operator.itemgetter(*store.LOADED_COLUMNS)  # event fields in table column order, at C speed


def _offsets(records) -> dict[TopicPartition, OffsetAndMetadata]:
    """The offsets that acknowledge exactly these records: per partition, the last offset + 1."""
    last: dict[TopicPartition, int] = {}
    for rec in records:
        tp = TopicPartition(rec.topic, rec.partition)
        if rec.offset >= last.get(tp, -1):
            last[tp] = rec.offset
    return {tp: OffsetAndMetadata(off + 1, "", -1) for tp, off in last.items()}


def _reason(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ())) or "event"
        parts.append(f"{loc}: {err.get('msg')}")
    return "; ".join(parts)


class UsageLoader:
    def __init__(self, bootstrap_servers: str, store_path: Path, topic: str = "llm.usage.v1",
                 group_id: str = "usage-loader", dlq_topic: str = "llm.usage.v1.dlq",
                 known_callers: Callable[[], set[str]] | None = None, batch_max: int = 50_000,
                 fault: str = "", writer_id: str = "", lake: lake_mod.Lake | None = None,
                 dedup_window_s: float = DEFAULT_WINDOW_S, maintain_every_s: float = 3600.0) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.store_path = Path(store_path)
        self.lake = lake or lake_mod.lake_for(self.store_path)
        self.writer = writer_id or group_id
        self.recent = RecentIds(dedup_window_s)
        self._seq: int | None = None  # next batch number; None = recover first
        self.maintain_every_s = maintain_every_s
        self._maintained_at = time.monotonic()
        self.topic, self.group_id, self.dlq_topic = topic, group_id, dlq_topic
        self.batch_max = batch_max
        self.fault = fault
        self._known_callers_fn = known_callers
        self._callers: set[str] | None = None
        self._callers_at = 0.0
        self._consumer = None
        self._dlq = None
        self.stats = {"batches": 0, "consumed": 0, "inserted": 0, "duplicates": 0, "rejected": 0, "errors": 0}
        self.timings = {"validate_s": 0.0, "write_s": 0.0}  # wall time per phase, for the benchmark
        self.started_at, self.last_stored_at, self.lag, self.lag_checked_at = time.time(), 0.0, 0, 0.0  # metrics
        self.metrics_db_url = ""  # registry of the budgets, when the loader's metrics are served
        self.rebalance = Rebalance(self.writer)  # partitions moving between workers (usage/rebalance.py)

    # ---- one batch ------------------------------------------------------------------------------
    def run_once(self, max_wait_s: float = 1.0) -> int:
        """Poll one batch, store it, commit its offsets. Returns the number of records consumed."""
        records = self._poll(max_wait_s)
        if records:
            self._store(self._validate(records), len(records))
            self._ensure_consumer().commit(_offsets(records))  # only now: a crash before re-delivers
        return len(records)

    def _poll(self, max_wait_s: float) -> list:
        """Up to batch_max records, waiting at most max_wait_s for the first ones."""
        consumer = self._ensure_consumer()
        records: list = []
        deadline = time.monotonic() + max_wait_s
        generation = self.rebalance.generation
        while len(records) < self.batch_max:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Once something arrived, only top the batch up with what is already there.
            timeout = left if not records else min(left, 0.05)
            polled = consumer.poll(timeout_ms=int(timeout * 1000), max_records=self.batch_max - len(records))
            got = [r for part in polled.values() for r in part]
            if self.rebalance.generation != generation:  # partitions moved: drop what we no longer own
                generation = self.rebalance.generation
                records = Rebalance.keep_assigned(consumer, records)
            if not got and records:
                break
            records.extend(got)
        return records

    def _store(self, validated: tuple[list[tuple], list, dict], consumed: int) -> None:
        """The batch's events, rollups and rejects in the lake, then the dead letters (flushed). Runs on the
        writer thread in `run()`; Parquet encoding and the commits release the GIL, so the next poll overlaps."""
        rows, rejects, origins = validated
        t0 = time.perf_counter()
        try:
            if self._seq is None or self.rebalance.reseed.is_set():
                # after start, an error, or new partitions: the window from what the lake holds now
                self.rebalance.reseed.clear()
                self.recover()
            rows = [r for r in rows if r[0] not in self.recent]
            rejects = [r for r in rejects if r[0] not in self.recent]
            try:
                table = store.events_table(rows, self.writer, self._seq)
            except (pa.ArrowException, ValueError, OverflowError) as exc:
                # A schema-valid event the store cannot hold would fail this batch forever: dead-letter it.
                log.warning("usage batch refused by the store (%s); converting its %d events one by one",
                            exc, len(rows))
                table = self._convert_singly(rows, rejects, origins)
            self._write(table, rejects)
        except Exception:
            self._seq = None  # the lake may hold part of the batch: recover before the next one
            raise
        self._fault("after_write")
        if rejects:
            self._send_dead_letters(rejects)
        self.timings["write_s"] += time.perf_counter() - t0
        inserted = table.num_rows
        self.stats["batches"] += 1
        self.stats["consumed"] += consumed
        self.stats["inserted"] += inserted
        self.stats["duplicates"] += consumed - len(rejects) - inserted  # repeats in or across batches
        self.stats["rejected"] += len(rejects)
        loader_metrics.mark_stored(self)

    def _write(self, table: pa.Table, rejects: list) -> None:
        seq = self._seq
        if table.num_rows:
            meta = {"writer": self.writer, "seq": str(seq)}
            lake_mod.append(self.lake, lake_mod.EVENTS, table, txn=(f"events:{self.writer}", seq), metadata=meta)
            self._fault("mid_write")  # killed here: events in, rollups not; recover() completes the batch
            lake_mod.append(self.lake, lake_mod.ROLLUPS, rollups.rollup(table),
                            txn=(f"rollups:{self.writer}", seq), metadata=meta)
            self._seq = seq + 1
        if rejects:
            lake_mod.append(self.lake, lake_mod.REJECTS, store.rejects_table(
                [(rid, reason, raw) for rid, reason, raw, _ in rejects], self.writer, seq))
        self.recent.add([r[0] for r in rejects] + table.column("request_id").to_pylist())

    def _convert_singly(self, rows: list[tuple], rejects: list, origins: dict) -> pa.Table:
        """Convert rows one at a time; the ones the store refuses join `rejects`."""
        good = []
        for row in rows:
            try:
                store.events_table([row], self.writer, self._seq)
            except (pa.ArrowException, ValueError, OverflowError) as exc:
                rid, raw, key = origins[row[0]]
                rejects.append((rid, f"the store refused it: {str(exc).splitlines()[0]}", raw, key))
            else:
                good.append(row)
        return store.events_table(good, self.writer, self._seq)

    def recover(self) -> None:
        """Complete an interrupted batch and re-seed the de-duplication window (usage/recovery.py)."""
        self._seq = recovery.recover(self.lake, self.store_path, self.writer, self.recent)

    def maybe_maintain(self) -> None:
        """Retention and compaction once every maintain_every_s (usage/retention.py); errors are logged."""
        if self.maintain_every_s <= 0 or time.monotonic() - self._maintained_at < self.maintain_every_s:
            return
        self._maintained_at = time.monotonic()
        try:
            log.info("usage maintenance: %s", retention.maintain(self.lake))
        except Exception as exc:
            log.warning("usage maintenance failed (%s: %s); retrying in %.0f s", type(exc).__name__, exc,
                        self.maintain_every_s)

    def _validate(self, records) -> tuple[list[tuple], list[tuple[str, str, str, bytes | None]], dict]:
        t0 = time.perf_counter()
        rows: dict[str, tuple] = {}
        origins: dict[str, tuple[str, str, bytes | None]] = {}  # request_id -> (reject id, raw, key)
        rejects = []
        callers = self._caller_set()
        for rec in records:
            raw: bytes = rec.value or b""
            reason = None
            try:
                ev = UsageEvent.model_validate_json(raw)
            except ValidationError as exc:
                reason = _reason(exc)
            else:
                if ev.cached_prompt_tokens > ev.prompt_tokens:
                    reason = "cached_prompt_tokens exceeds prompt_tokens"
                elif not 0 <= ev.ts < MAX_TS:
                    reason = f"ts: {ev.ts!r} is not a unix time in seconds before year 10000"
                elif max(ev.prompt_tokens, ev.completion_tokens) > MAX_TOKENS or not (
                        math.isfinite(ev.ttft_ms) and math.isfinite(ev.duration_ms)):
                    reason = "token counts over 2^62 or non-finite timings"
                elif callers is not None and ev.caller not in callers:
                    callers = self._caller_set(missed=True)  # maybe created a moment ago
                    if callers is not None and ev.caller not in callers:
                        reason = f"unknown caller {ev.caller!r}"
            rid = f"{rec.topic}/{rec.partition}/{rec.offset}/{zlib.crc32(raw):08x}"
            if reason is None:
                if ev.request_id not in rows:
                    rows[ev.request_id] = _row(ev.__dict__)
                    origins[ev.request_id] = (rid, raw.decode("utf-8", "replace"), rec.key)
            else:
                rejects.append((rid, reason, raw.decode("utf-8", "replace"), rec.key))
        self.timings["validate_s"] += time.perf_counter() - t0
        return list(rows.values()), rejects, origins

    def _caller_set(self, missed: bool = False) -> set[str] | None:
        """Known callers, refreshed every CALLER_REFRESH_S (sooner after a miss); None = no check, which is
        also the answer until a first load succeeded (a registry outage must not dead-letter everything)."""
        if self._known_callers_fn is None:
            return None
        age = time.monotonic() - self._callers_at
        if age > CALLER_REFRESH_S or (missed and age > CALLER_MISS_REFRESH_S):
            self._callers_at = time.monotonic()
            try:
                self._callers = set(self._known_callers_fn())
            except Exception as exc:  # registry briefly down: keep the last known set
                log.warning("could not refresh known callers: %s", exc)
        return self._callers

    def _send_dead_letters(self, rejects) -> None:
        if self._dlq is None:
            self._dlq = make_producer(self.bootstrap_servers, client_id=f"{self.group_id}-dlq")
        futures = []
        for rid, reason, raw, key in rejects:
            topic, part, offset, _ = rid.split("/")
            value = json.dumps({"reason": reason, "raw": raw, "source": {"topic": topic, "partition": int(part),
                                "offset": int(offset)}, "at": time.time()}).encode()
            futures.append(self._dlq.send(self.dlq_topic, key=key, value=value))
        self._dlq.flush(timeout=15)
        for fut in futures:
            fut.get(timeout=0)
        log.warning("%d usage events rejected to %s (e.g. %s)", len(rejects), self.dlq_topic, rejects[0][1])

    # ---- loop -----------------------------------------------------------------------------------
    def run(self, stop_event: threading.Event | None = None, max_wait_s: float = 1.0) -> None:
        """Load batches until stop_event is set. Pipelined: while batch N is written to the lake on a writer
        thread, batch N+1 is polled and validated; N's offsets are committed only after N's write.
        Broker or store errors are logged and retried with a new consumer (uncommitted batches are
        re-delivered and de-duplicated)."""
        stop_event = stop_event or threading.Event()
        last_report = time.monotonic()
        writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-writer")
        while not stop_event.is_set():
            try:
                records = self._poll(max_wait_s)  # a rebalance in here waits for the in-flight write
                self._commit_inflight()
                if records:
                    validated = self._validate(records)
                    self.rebalance.inflight = InFlight(writer.submit(self._store, validated, len(records)),
                                                       _offsets(records))
            except Exception as exc:
                self.stats["errors"] += 1
                log.warning("usage loader batch failed (%s: %s); reconnecting", type(exc).__name__, exc)
                if self.rebalance.inflight is not None:
                    self.rebalance.inflight.future.exception()  # let the write finish before the next one starts
                    self.rebalance.inflight = None
                self._close_clients()
                stop_event.wait(1.0)
            loader_metrics.refresh_lag(self, time.monotonic())
            loader_metrics.refresh_spend(self, time.monotonic(), self.metrics_db_url)
            if time.monotonic() - last_report > 30:
                log.info("usage loader: %s", self.stats)
                last_report = time.monotonic()
        try:
            self._commit_inflight()
        except Exception as exc:  # stopping anyway: the batch is re-delivered and de-duplicated
            log.warning("usage loader: last batch not committed (%s)", exc)
        writer.shutdown(wait=True)
        self.close()

    def _commit_inflight(self) -> None:
        """Wait for the in-flight batch's write (re-raising its failure: its offsets are then never committed)
        and commit its offsets, less those of partitions a rebalance took away meanwhile."""
        flight = self.rebalance.inflight
        if flight is None:
            return
        flight.future.result()
        if flight.offsets:
            self._ensure_consumer().commit(flight.offsets)
        self.rebalance.inflight = None
        self.maybe_maintain()

    def close(self) -> None:
        self._close_clients()

    def _ensure_consumer(self):
        if self._consumer is None:
            ensure_topics(self.bootstrap_servers, [self.topic, self.dlq_topic])
            self._consumer = make_consumer(self.bootstrap_servers, self.topic, self.group_id, self.batch_max,
                                           listener=self.rebalance)
        return self._consumer

    def _close_clients(self) -> None:
        if self._dlq is not None:
            close_producer(self._dlq)
        if self._consumer is not None:
            try:
                self._consumer.close(autocommit=False)  # offsets are committed only after a write
            except Exception:
                pass
        self._consumer = self._dlq = None

    def _fault(self, point: str) -> None:
        """Fault injection for the crash tests (Settings.usage_fault, FLEET_USAGE_FAULT=mid_write|after_write) kills the process
        inside the store transaction, or after it committed but before the offset commit."""
        if self.fault == point:
            os._exit(137)

