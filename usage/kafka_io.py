"""Kafka client settings shared by the usage producer and loader, and topic creation.

Kept in one place so the producer, the loader's dead-letter producer and the consumer agree on
timeouts. Nothing here is tansu-specific except the consumer's short group timeouts, which are also
sane for a real Kafka; the same code runs unchanged against any broker in KAFKA_BOOTSTRAP_SERVERS.
"""
from __future__ import annotations

import logging

from kafka import ConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

log = logging.getLogger(__name__)

DEFAULT_PARTITIONS = 4  # room for several loader workers in the group


def make_producer(bootstrap_servers: str, client_id: str) -> KafkaProducer:
    """An idempotent acks=all producer. Timeouts are short because our own spool is the retry buffer:
    a send that fails is simply resent from the spool, so waiting minutes inside the client buys nothing."""
    return KafkaProducer(
        bootstrap_servers=bootstrap_servers, client_id=client_id,
        acks="all", enable_idempotence=True, max_in_flight_requests_per_connection=5,
        linger_ms=5, batch_size=512 * 1024, max_request_size=8 * 1024 * 1024,
        request_timeout_ms=5000, delivery_timeout_ms=10000, max_block_ms=3000,
        reconnect_backoff_ms=100, reconnect_backoff_max_ms=1000, metadata_max_age_ms=5000,
    )


def make_consumer(bootstrap_servers: str, topic: str, group_id: str, max_poll_records: int,
                  listener: ConsumerRebalanceListener | None = None) -> KafkaConsumer:
    """A manual-commit group consumer. session/heartbeat timeouts are short because tansu (and small
    real clusters) otherwise make each group join wait ~23 s; metadata is refreshed every 5 s so a topic
    re-created after a broker restart is picked up quickly. `listener` hears of partitions assigned and revoked."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap_servers, group_id=group_id, client_id=f"{group_id}-consumer",
        enable_auto_commit=False, auto_offset_reset="earliest",
        session_timeout_ms=6000, heartbeat_interval_ms=1000, max_poll_interval_ms=300_000,
        max_poll_records=max_poll_records, fetch_max_bytes=64 * 1024 * 1024,
        max_partition_fetch_bytes=16 * 1024 * 1024, fetch_max_wait_ms=200,
        request_timeout_ms=30_000, reconnect_backoff_ms=100, reconnect_backoff_max_ms=1000,
        metadata_max_age_ms=5000,
    )
    consumer.subscribe([topic], listener=listener)
    return consumer


def ensure_topics(bootstrap_servers: str, topics: list[str], partitions: int = DEFAULT_PARTITIONS) -> None:
    """Create the topics if missing. Errors are logged, not raised: on a managed cluster the topics may
    be provisioned by someone else and we may lack the right to create them."""
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap_servers, client_id="usage-admin",
                                 request_timeout_ms=5000, bootstrap_timeout_ms=3000)
    except Exception as exc:  # broker down: the caller retries later
        log.debug("admin client unavailable: %s", exc)
        raise
    try:
        existing = set(admin.list_topics())
        missing = [NewTopic(t, partitions, 1) for t in topics if t not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                pass
            except Exception as exc:
                log.warning("could not create topics %s: %s", [t.name for t in missing], exc)
    finally:
        admin.close()


def close_producer(producer: KafkaProducer, timeout_s: float = 1.0) -> None:
    """Close a producer even when the broker is gone. kafka-python's close() first flushes and, if that
    times out, raises before stopping its sender thread, which then lives on (and its __del__ retries);
    so on failure stop the sender ourselves."""
    try:
        producer.close(timeout=timeout_s)
    except Exception:
        sender = getattr(producer, "_sender", None)
        if sender is not None:
            sender.force_close()
        producer._closed = True  # nothing left for __del__ to do
