"""Usage metering: event schema, Kafka producer with a durable local spool, exactly-once loader into the usage
lake (Delta tables + hourly rollups, read by DuckDB), chargeback."""
