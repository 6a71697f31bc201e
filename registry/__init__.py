"""Model registry: the one source of truth for models, routes, adapters, callers, warm buffers and replicas."""
