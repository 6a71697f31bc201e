"""The router's usage producer: spool first, then Kafka (acks=all, idempotent), then drop from the spool.
Streams in flight are kept in an mmap ledger (`usage.inflight`) so a router that dies mid-stream still
bills the tokens it streamed: the next producer on the same spool spools them.

`emit()` is the only call on the request path: it serialises the event and appends it to the local
spool (`usage.spool`), a few microseconds, never touching the network. A background sender thread reads
the spool in append order, sends to Kafka with key = caller (so one caller's events share a partition
and stay in order), waits for the broker's acknowledgement, and only then advances the spool's
acknowledged position. If the broker is down the sender backs off and retries the same records from
the spool, rebuilding its Kafka client (a restarted broker does not know the old idempotent producer
id). A router restart reopens the spool and resends everything not yet acknowledged. Resending can
produce a duplicate in Kafka when an acknowledgement was lost; the loader de-duplicates on request_id,
so each event lands in the store exactly once.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from kafka import KafkaProducer

from usage.events import UsageEvent
from usage.inflight import InflightLedger
from usage.kafka_io import close_producer, ensure_topics, make_producer
from usage.spool import Spool

log = logging.getLogger(__name__)

BATCH_RECORDS = 5000
IDLE_WAIT_S = 0.05
BACKOFF_MAX_S = 5.0
# After a send failure, events acknowledged in the last REPLAY_WINDOW_S are sent again once the broker is
# back: a broker that came back without its log (in-memory tansu) has lost those the loader had not read.
# Costs duplicates in Kafka after an outage, which the loader drops; must exceed the loader's lag.
REPLAY_WINDOW_S = 30.0


class _Rewound(Exception):
    """The spool was rewound for a replay: the batch in hand is stale."""


class UsageProducer:
    def __init__(self, bootstrap_servers: str, spool_dir: Path, topic: str = "llm.usage.v1",
                 replay_window_s: float = REPLAY_WINDOW_S) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.spool = Spool(Path(spool_dir), replay_window_s=replay_window_s)
        self.ledger = InflightLedger(Path(spool_dir) / "inflight")
        self._recover_inflight()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kafka: KafkaProducer | None = None
        self._idle = threading.Condition()
        self.sent = 0          # records acknowledged by the broker since start (duplicates included)
        self.send_failures = 0  # batches that failed and were retried from the spool
        self.replayed = 0       # acknowledged events sent again after a failure (see REPLAY_WINDOW_S)
        self.last_error: str | None = None
        self.ack_failures = 0   # acknowledged positions that could not be written (disk full)

    # ---- request path ---------------------------------------------------------------------------
    def emit(self, event: UsageEvent) -> None:
        """Durably spool one event; returns in microseconds and never waits for the broker. Thread-safe
        and safe to call from an asyncio loop (one short local file write, no await points)."""
        self.spool.append(event.key(), event.to_json_bytes())
        self._wake.set()

    def _recover_inflight(self) -> None:
        """Spool the usage of streams that a router which died mid-stream left in the ledger (see usage.inflight)."""
        left = self.ledger.leftovers()
        for slot, event in left:
            self.spool.append(event.key(), event.to_json_bytes())
            self.ledger.close(slot)
        if left:
            log.warning("spooled the usage of %d streams a previous router left unfinished (%d tokens)",
                        len(left), sum(e.completion_tokens for _, e in left))

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> UsageProducer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="usage-producer", daemon=True)
            self._thread.start()
        return self

    def pending(self) -> int:
        """Events in the spool that the broker has not acknowledged yet."""
        return self.spool.pending()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until the spool is empty (every event acknowledged); False on timeout."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        with self._idle:
            while self.spool.pending() > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.1))
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Try to drain for up to timeout_s, then stop; whatever is left stays spooled for the next start."""
        if self._thread is not None:
            self.flush(timeout_s)
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=15)
            self._thread = None
        self._drop_kafka()
        self.ledger.flush_and_close()
        self.spool.close()

    # ---- sender thread --------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            batch = self.spool.read_batch(BATCH_RECORDS)
            if not batch:
                with self._idle:
                    self._idle.notify_all()
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                self._send(batch)
            except _Rewound:
                continue  # read again from the rewound position
            except Exception as exc:  # broker down, topic gone, producer fenced: resend from the spool
                self.send_failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("usage send of %d events failed (%s); retrying in %.1f s (%d spooled)",
                            len(batch), self.last_error, backoff, self.spool.pending())
                self._drop_kafka()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            backoff = 0.2
            self.sent += len(batch)
            try:
                self.spool.ack(batch[-1].end, len(batch))
            except OSError as exc:  # e.g. ENOSPC for the ack file: the position is kept in memory, the next ack persists it
                self.ack_failures += 1
                log.error("usage spool: could not persist the acknowledged position (%s); a restart now would "
                          "resend up to %d events, which the loader de-duplicates", exc, len(batch))

    def _send(self, batch) -> None:
        if self._kafka is None:
            ensure_topics(self.bootstrap_servers, [self.topic])
            self._kafka = make_producer(self.bootstrap_servers, client_id="usage-producer")
            if self.send_failures:
                replay = self.spool.rewind()
                if replay:
                    self.replayed += replay
                    log.warning("usage broker reconnected: re-sending %d recently acknowledged events", replay)
                    raise _Rewound()
        futures = [self._kafka.send(self.topic, key=r.key, value=r.value) for r in batch]
        self._kafka.flush(timeout=15)
        for fut in futures:
            fut.get(timeout=0)  # raises the broker's error for any record not acknowledged

    def _drop_kafka(self) -> None:
        if self._kafka is not None:
            close_producer(self._kafka)
            self._kafka = None
