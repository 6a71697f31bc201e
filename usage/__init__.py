"""Usage metering: event schema, Kafka producer with a durable local spool, loader into DuckDB, chargeback."""
