"""The running platform shared by the integration tests lives in tests/conftest.py (`platform`), so the
observability tests (tests/observability) share the same session's `fleet up`."""
