"""Triton shim for the decoupled `engine` model: parse tensors, enqueue into the engine loop, stream back.

`execute` never waits for generation: each request is handed to the EngineLoop (python_backends.engine.loop)
with its response sender, and the loop (which builds the engine on its own thread) sends one response per
released token delta - under load a few tokens at a time (stream_interval); the last response carries
finish_reason + usage and the COMPLETE_FINAL flag. Cancellation is polled from the loop thread.
"""
import json
import logging

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backends.engine.config import EngineConfig, engine_overrides
from python_backends.engine.engine import LLMEngine, StepOutput
from python_backends.engine.loop import EngineLoop
from python_backends.engine.metrics import TritonMetrics
from python_backends.engine.sequence import SamplingParams
from python_backends.engine.state_report import StateReporter, clear_stale_drain, identity_from_env
from python_backends.engine.tracing import record_request
from python_backends.engine.warmup import warm_up
from common import tracing
from common.logs import setup_logging
from common.settings import load_settings

log = logging.getLogger("engine")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    arr = tensor.as_numpy().reshape(-1)
    return arr[0] if arr.size else default


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


_FIELDS = {"logprobs": bool, "top_logprobs": int, "presence_penalty": float, "frequency_penalty": float,
           "repetition_penalty": float, "min_p": float, "min_tokens": int}


def _sampling_fields(params: SamplingParams, raw) -> None:
    """The OpenAI sampling fields from the JSON request parameter `sampling` (the router sends only those that
    differ from their defaults); types are checked here, bounds by the engine (common.sampling_fields)."""
    if not raw:
        return
    fields = json.loads(raw)
    if not isinstance(fields, dict):
        raise ValueError("parameter sampling: must be a JSON object")
    for name, value in fields.items():
        if name in _FIELDS:
            kind = _FIELDS[name]
            if kind is bool and not isinstance(value, bool) or kind is not bool and (
                    isinstance(value, bool) or not isinstance(value, (int, float)) or
                    (kind is int and not isinstance(value, int))):
                raise ValueError(f"sampling.{name}: must be {kind.__name__}, got {value!r}")
            setattr(params, name, kind(value))
        elif name == "logit_bias" and isinstance(value, dict):
            params.logit_bias = {int(k): float(v) for k, v in value.items()}
        elif name == "stop_token_ids" and isinstance(value, list):
            params.stop_token_ids = [int(t) for t in value]
        elif name == "guided" and isinstance(value, dict):
            params.guided = value
        else:
            raise ValueError(f"sampling.{name}: unknown field or wrong type")


class _TritonSink:
    def __init__(self, sender, loop: EngineLoop, trace_context=None, replica_id=""):
        self.sender = sender
        self.loop = loop
        self.trace_context, self.replica_id = trace_context, replica_id  # W3C fields from the router, or None

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()

    def send(self, out: StepOutput) -> None:
        tensors = [
            pb_utils.Tensor("output_ids", np.asarray(out.token_ids, dtype=np.int32)),
            pb_utils.Tensor("sequence_index", np.asarray([out.seq.seq_id], dtype=np.uint64)),
            pb_utils.Tensor("finish_reason", np.asarray([out.finish_reason.encode()], dtype=np.object_)),
            pb_utils.Tensor("usage", np.asarray(out.usage, dtype=np.int32)),
        ]
        if out.logprobs is not None:   # asked for (request parameter `sampling`): per id, then k pairs per id
            k = out.seq.params.top_logprobs
            tensors += [
                pb_utils.Tensor("output_logprobs", np.asarray([lp for lp, _ in out.logprobs], dtype=np.float32)),
                pb_utils.Tensor("top_logprob_ids", np.asarray([t for _, top in out.logprobs for t, _ in top[:k]],
                                                              dtype=np.int32)),
                pb_utils.Tensor("top_logprobs", np.asarray([p for _, top in out.logprobs for _, p in top[:k]],
                                                           dtype=np.float32)),
            ]
        if out.finish_reason == "error":
            # A failure is an error response with the engine's message, never a quiet finish_reason: the router
            # answers a refusal (`refused: ` + why, before any token) with a 4xx and retries/resumes the rest.
            if out.seq.error:
                message = f"refused: {out.seq.error}"
            else:
                message = f"engine step failed: {self.loop.error!r}" if self.loop.error else "engine step failed"
            log.warning("request %s failed: %s", out.seq.request_id, message)
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)
            return
        response = pb_utils.InferenceResponse(output_tensors=tensors)
        self.sender.send(response, flags=FINAL if out.finished else 0)
        if out.finished and self.trace_context:
            record_request(self.trace_context, out.seq, out.finish_reason, self.replica_id)


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        self.config = EngineConfig.from_params(params, engine_overrides())  # FLEET_ENGINE_* read once, here
        if args.get("model_instance_kind") == "GPU" and self.config.device in ("cuda", "auto"):
            # KIND_GPU: Triton places each instance on a GPU of its own; the engine follows that choice
            self.config.device = f"cuda:{args.get('model_instance_device_id', 0)}"
        identity = identity_from_env()
        settings = load_settings()
        # The engine says at start what it chose (KV pool size, CPU kernels, decode attention): the replica's log
        setup_logging("replica", settings.log_level, settings.log_format)
        tracing.configure("fleet-replica", settings.otlp_endpoint, settings.trace_sample_ratio,
                          **{"fleet.replica": identity["replica_id"]})
        self.replica_id = identity["replica_id"]
        labels = {"replica_id": identity["replica_id"], "model": identity["model"] or "engine",
                  "version": str(identity["version"] or "")}
        self.metrics = TritonMetrics(pb_utils, labels)
        clear_stale_drain(self.replica_id)
        self.reporter = StateReporter(identity, self.config.state_full_snapshot_s).start()

        def on_tick(engine: LLMEngine) -> None:
            self.metrics.update(engine)
            if self.reporter.routers:
                self.reporter.publish(self.reporter.build(engine))

        def build() -> LLMEngine:   # runs on the loop thread, where every step runs (python_backends.engine.loop)
            engine = LLMEngine(self.config)
            engine.stats.sink = self.metrics
            return engine

        self.loop = EngineLoop(build, on_tick=on_tick, tick_s=self.config.state_report_interval_s).start()
        self.engine = self.loop.engine
        # warm before ready: Triton reports the model ready only once initialize returns (warmup.py)
        warm_up(self.loop, self.config.warmup_seqs)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._enqueue(request, sender)
            except Exception as exc:   # malformed request: answer it alone, never break the batch
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"bad engine request: {exc}")),
                            flags=FINAL)
        return None

    def _enqueue(self, request, sender) -> None:
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1).astype(np.int64)
        stop_tensor = pb_utils.get_input_tensor_by_name(request, "stop_words")
        stops = [_text(s) for s in stop_tensor.as_numpy().reshape(-1)] if stop_tensor is not None else []
        seed = _scalar(request, "random_seed", None)
        params = SamplingParams(
            max_tokens=int(_scalar(request, "max_tokens", self.config.default_max_tokens)),
            temperature=float(_scalar(request, "temperature", 0.0)),
            top_p=float(_scalar(request, "top_p", 1.0)) or 1.0,
            top_k=int(_scalar(request, "top_k", 0)),
            seed=int(seed) if seed is not None else None,
            stop=[s for s in stops if s])
        lora = _text(_scalar(request, "lora_name", b""))
        rp = json.loads(request.parameters() or "{}")
        params.ignore_eos = bool(rp.get("ignore_eos", False))   # benchmarks: same output length everywhere
        params.seed_offset = int(rp.get("seed_offset", 0) or 0)  # a resumed stream: tokens generated before
        _sampling_fields(params, rp.get("sampling"))
        # `priority` is reserved by tritonclient (it is Triton's own scheduling field), so the router sends
        # `llm_priority`; accept both names.
        priority = int(rp.get("llm_priority", rp.get("priority", 1)))
        trace_context = {k: rp[k] for k in tracing.TRACE_KEYS if isinstance(rp.get(k), str)} or None
        prompt, deadline_ms = ids.tolist(), int(rp.get("deadline_ms", 0) or 0)
        request_id = rp.get("request_id") or request.request_id()   # read now: `submit` may run after execute

        def submit() -> None:
            self.loop.submit(prompt, params, _TritonSink(sender, self.loop, trace_context, self.replica_id),
                             priority=priority, deadline_ms=deadline_ms, lora_name=lora, request_id=request_id)

        if params.guided is None:
            return submit()

        def compiled(grammar, problem: str) -> None:   # on the replica's compile thread (or here when cached)
            if problem:   # "refused: " is final for the router; a busy replica's error is retried elsewhere
                prefix = "" if problem.startswith("busy:") else "refused: "
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(prefix + problem)), flags=FINAL)
                return
            params.grammar = grammar
            submit()
        # never on this thread (every new request of the replica waits for it) nor on the engine loop
        self.loop.engine.grammars().compile_later(params.guided, compiled)

    def finalize(self):
        self.loop.stop()
        self.reporter.stop()
