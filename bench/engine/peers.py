"""The systems the benchmark drives: our engine through Triton (gRPC streaming), transformers `generate`
with static batches (run in a child process), and llama.cpp's `llama-server --parallel N` (HTTP streaming).

Each client takes requests in arrival order, keeps at most `concurrency` in flight, and records for every
request its arrival, first-token and per-token times, so all systems are measured the same way.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from bench.engine.workload import Request


@dataclass
class Result:
    idx: int
    arrival: float
    token_times: list[float] = field(default_factory=list)
    n_tokens: int = 0
    cached: int = 0
    prompt: int = 0
    error: str = ""


async def _dispatch(requests: list[Request], concurrency: int, run_one) -> list[Result]:
    """Open-loop Poisson arrivals, at most `concurrency` requests in flight (the rest queue client-side);
    `run_one(request, result)` is a coroutine that fills in the result's times, an exception its error."""
    t0 = time.time() + 0.5
    results = [Result(r.idx, t0 + r.arrival_s) for r in requests]
    slots = asyncio.Semaphore(concurrency)

    async def guarded(r: Request, res: Result) -> None:
        try:
            await run_one(r, res)
        except Exception as exc:   # recorded, reported as an error count
            res.error = repr(exc)
        finally:
            slots.release()

    tasks = []
    for r, res in zip(requests, results):
        delay = res.arrival - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        await slots.acquire()
        tasks.append(asyncio.create_task(guarded(r, res)))
    await asyncio.gather(*tasks)
    return results


def run_triton(grpc_url: str, requests: list[Request], concurrency: int, model: str = "engine",
               api_key: str = "") -> list[Result]:
    """KServe gRPC streaming: a replica's Triton (model `engine`) or, with an API key, the router (the
    registry's model name; the router takes the same input_ids/max_tokens tensors).

    All streams share one channel and one event loop in one thread, as a service calling the platform would.
    A client per request (one channel and one response thread each, as tritonclient's stream API needs) had
    up to 36 threads runnable during a 32-stream burst on the 2 cores the server uses too, which delayed
    its first tokens by seconds."""
    return asyncio.run(_run_triton_async(grpc_url, requests, concurrency, model, api_key))


async def _run_triton_async(grpc_url: str, requests: list[Request], concurrency: int, model: str,
                            api_key: str) -> list[Result]:
    import grpc
    from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc

    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def infer_request(r: Request) -> "service_pb2.ModelInferRequest":
        req = service_pb2.ModelInferRequest(model_name=model, id=str(r.idx))
        for name, values in (("input_ids", r.prompt_ids), ("max_tokens", [r.max_tokens])):
            tensor = req.inputs.add(name=name, datatype="INT32")
            tensor.shape.append(len(values))
            req.raw_input_contents.append(np.asarray(values, dtype=np.int32).tobytes())
        req.parameters["ignore_eos"].bool_param = True
        if not api_key:
            req.parameters["llm_priority"].int64_param = 1
        return req

    async with grpc.aio.insecure_channel(grpc_url, options=[("grpc.max_receive_message_length", 1 << 26)]) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)

        async def one(r: Request, res: Result) -> None:
            call = stub.ModelStreamInfer(metadata=metadata)
            try:
                await call.write(infer_request(r))
                async for response in call:
                    if response.error_message:
                        raise RuntimeError(response.error_message)
                    t = time.time()
                    result = InferResult(response.infer_response)
                    res.token_times += [t] * result.as_numpy("output_ids").size
                    if result.as_numpy("finish_reason")[0]:
                        res.prompt, res.cached, res.n_tokens = result.as_numpy("usage").tolist()
                        return
                raise RuntimeError("stream ended without a final response")
            finally:
                call.cancel()

        return await _dispatch(requests, concurrency, one)


def run_llama_server(url: str, requests: list[Request], concurrency: int) -> list[Result]:
    """llama-server's HTTP streaming, one blocking client thread per request in flight."""
    def run_one(r: Request, res: Result) -> None:
        body = json.dumps({"prompt": r.prompt_ids, "n_predict": r.max_tokens, "stream": True, "ignore_eos": True,
                           "temperature": 0.0, "cache_prompt": True}).encode()
        req = urllib.request.Request(f"{url}/completion", data=body, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if event.get("content") or event.get("tokens"):
                    res.token_times.append(time.time())
                if event.get("stop"):
                    timings = event.get("timings", {})
                    res.n_tokens = int(timings.get("predicted_n", len(res.token_times)))
                    res.cached = int(timings.get("cache_n", 0))
                    res.prompt = len(r.prompt_ids)
                    return

    async def run() -> list[Result]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return await _dispatch(requests, concurrency,
                                   lambda r, res: loop.run_in_executor(pool, run_one, r, res))

    return asyncio.run(run())


def hf_worker(weights_dir: str, requests: list[Request], batch_size: int, dtype: str = "bf16",
              threads: int = 2) -> list[Result]:
    """Static batching: when idle, take up to batch_size arrived requests, left-pad, `generate` until the
    longest output of the batch is done. Token times come from a logits processor called once per step."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype])

    class Clock(LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            self.times.append(time.time())
            return scores

    t0 = time.time() + 0.5
    results = {r.idx: Result(r.idx, t0 + r.arrival_s) for r in requests}
    pending = list(requests)
    while pending:
        now = time.time()
        arrived = [r for r in pending if t0 + r.arrival_s <= now]
        if not arrived:
            time.sleep(max(0.0, t0 + pending[0].arrival_s - now))
            continue
        batch = arrived[:batch_size]
        pending = [r for r in pending if r not in batch]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[2] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        n = max(r.max_tokens for r in batch)
        clock = Clock()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           logits_processor=LogitsProcessorList([clock]), pad_token_id=2)
        for r in batch:
            res = results[r.idx]
            res.token_times = clock.times[:r.max_tokens]
            res.n_tokens, res.prompt = r.max_tokens, len(r.prompt_ids)
    return [results[r.idx] for r in requests]


def summarize(results: list[Result]) -> dict:
    ok = [r for r in results if not r.error and r.token_times]
    ttft = [r.token_times[0] - r.arrival for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    # time per output token after the first, per request: unlike ITL, the same whether tokens arrive one per
    # response or a few at a time (the engine's stream_interval)
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1]
    tokens = sum(r.n_tokens for r in ok)
    start = min(r.arrival for r in results)
    end = max(r.token_times[-1] for r in ok) if ok else start
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1000 if xs else None  # noqa: E731
    return {"requests": len(results), "errors": len(results) - len(ok), "output_tokens": tokens,
            "duration_s": end - start, "throughput_tok_s": tokens / (end - start) if end > start else 0.0,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p95": pct(ttft, 95),
            "ttft_ms_mean": float(np.mean(ttft)) * 1000 if ttft else None, "itl_ms_p50": pct(itl, 50),
            "itl_ms_p95": pct(itl, 95), "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p95": pct(tpot, 95),
            "prompt_tokens": sum(r.prompt for r in ok),
            "cached_prompt_tokens": sum(r.cached for r in ok),
            "first_error": next((r.error for r in results if r.error), "")}


def combine_runs(runs: list[dict]) -> dict:
    """One system's repeated runs of one level -> one result: the median of each numeric metric, the run-by-run
    throughputs (`throughput_tok_s_runs`, in run order, so ratios can be paired run by run with a peer's) and
    the errors of all runs added up. On a noisy VM a single run of the same system varied by +-15 % within
    minutes; the median of interleaved runs is what the ratios are taken from."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for name, value in runs[0].items():
        values = [r.get(name) for r in runs]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and None not in values:
            out[name] = float(np.median(values))
    out["errors"] = sum(r["errors"] for r in runs)
    out["first_error"] = next((r["first_error"] for r in runs if r["first_error"]), "")
    out["load_avg_before"] = [r.get("load_avg_before") for r in runs]
    out["cpu_busy_before"] = max(r.get("cpu_busy_before") or 0.0 for r in runs)
    out["runs"] = len(runs)
    out["throughput_tok_s_runs"] = [r["throughput_tok_s"] for r in runs]
    out["ttft_ms_p95_runs"] = [r["ttft_ms_p95"] for r in runs]
    return out
