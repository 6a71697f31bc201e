"""The CPU inference engine: paged KV cache, continuous batching with chunked prefill, prefix caching,
preemption, multi-LoRA and sampling, on our own forward in torch for each supported model family (models/).

Served by Triton as the decoupled Python-backend model `engine` (model_repository/engine/1/model.py);
usable in-process through `LLMEngine` (step-wise) or `EngineLoop` (background thread + callbacks).
"""
from python_backends.engine.config import EngineConfig
from python_backends.engine.sequence import FinishReason, Priority, SamplingParams

__all__ = ["EngineConfig", "FinishReason", "Priority", "SamplingParams"]
