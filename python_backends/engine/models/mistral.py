"""Mistral: Llama with a sliding window over every layer (`sliding_window`; null = full attention).

The window is a mask over the keys (ModelRunner.attention); a window at least the served context never binds
and is dropped, so Mistral 7B v0.2+ (no window) and v0.1 at <= 4096 tokens run the plain attention paths."""
from __future__ import annotations

from python_backends.engine.models.llama import LlamaModel


class MistralModel(LlamaModel):
    pass        # the window rule of LlamaModel.window (every layer when config.json has no layer_types) is Mistral's
