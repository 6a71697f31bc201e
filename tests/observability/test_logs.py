"""common.logs: JSON lines carry the request context of the task that logged them (and the current trace ids),
concurrent requests do not see each other's ids, lines about no request carry none, text stays readable."""
from __future__ import annotations

import asyncio
import io
import json
import logging

from opentelemetry.sdk.trace import TracerProvider

from common.logs import RequestContextFilter, bind_request, formatter

tracer = TracerProvider().get_tracer("test")


def _capture(fmt: str) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter("router", fmt))
    handler.addFilter(RequestContextFilter())
    log = logging.getLogger(f"test.logs.{fmt}")
    log.handlers, log.propagate = [handler], False
    log.setLevel(logging.INFO)
    return log, out


def test_json_lines_carry_each_requests_own_ids_and_trace():
    log, out = _capture("json")

    async def request(n: int) -> str:
        with tracer.start_as_current_span(f"req{n}") as span:
            bind_request(request_id=f"req-{n}", caller=f"caller{n}", model="m", version="1", tier="interactive")
            await asyncio.sleep(0.01 * (3 - n))   # interleave the two requests' lines
            log.info("working on it")
            bind_request(client_request_id=f"mine-{n}")
            log.info("done", extra={"status": "ok", "ttft_ms": 12.5})
            return format(span.get_span_context().trace_id, "032x")

    async def both() -> list[str]:
        return await asyncio.gather(request(1), request(2))

    trace_ids = asyncio.run(both())
    log.info("not about a request")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 5
    for n, trace_id in zip((1, 2), trace_ids):
        mine = [r for r in lines if r.get("request_id") == f"req-{n}"]
        assert len(mine) == 2 and all(r["trace_id"] == trace_id and r["caller"] == f"caller{n}" for r in mine)
        assert all((r["model"], r["version"], r["tier"], r["component"]) == ("m", "1", "interactive", "router")
                   for r in mine)
        assert mine[1]["client_request_id"] == f"mine-{n}" and mine[1]["status"] == "ok"
        assert mine[1]["ttft_ms"] == 12.5 and mine[1]["message"] == "done" and mine[1]["level"] == "INFO"
    assert lines[-1]["message"] == "not about a request"
    assert not {"request_id", "trace_id", "caller", "model"} & set(lines[-1])


def test_text_lines_name_the_request():
    log, out = _capture("text")

    async def request() -> None:
        bind_request(request_id="req-7")
        log.warning("replica failed")
    asyncio.run(request())
    log.info("idle")
    first, second = out.getvalue().splitlines()
    assert first.endswith("router test.logs.text: replica failed [request_id=req-7]") and " WARNING " in first
    assert second.endswith("router test.logs.text: idle")
