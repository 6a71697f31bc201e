"""A small random-init Llama (transformers) and the engine on its very tensors, for tests that need no weights
on disk: the same helpers run on the CPU and on a CUDA device."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.engine.random_models import random_hf_llama
from python_backends.engine.config import EngineConfig
from python_backends.engine.engine import LLMEngine
from python_backends.engine.sequence import SamplingParams

SMALL = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
             intermediate_size=256, vocab_size=2000, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64})


def hf_model(device: str, dtype=torch.float32, seed: int = 0, **over):
    return random_hf_llama({**SMALL, **over}, device, dtype, seed)


def engine_on(model, tmp: Path, device: str, dtype: str = "fp32", adapters_dir: str = "", **over) -> LLMEngine:
    (tmp / "config.json").write_text(json.dumps(model.config.to_dict(), default=str))
    sd = {k: v.detach() for k, v in model.state_dict().items() if "lora_" not in k}
    sd = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in sd.items()}
    cfg = dict(weights_dir=str(tmp), adapters_dir=adapters_dir, dtype=dtype, device=device, max_context=256,
               num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=32, threads=1)
    cfg.update(over)
    return LLMEngine(EngineConfig(**cfg), state_dict=sd)


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def run_all(engine: LLMEngine, requests: list[tuple[list[int], int, str]]) -> list[list[int]]:
    """(prompt, max_tokens, adapter) each, all submitted at once, greedy; ids per request in order."""
    seqs = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True), lora_name=a) for p, n, a in requests]
    got: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
    while engine.has_work():
        for o in engine.step():
            got[o.seq.seq_id].extend(o.token_ids)
    return [got[s.seq_id] for s in seqs]


def prefill_logits(engine: LLMEngine, prompt: list[int], lora_slot: int = -1) -> torch.Tensor:
    """fp32 logits at every prompt position (teacher forcing) through the engine's runner; writes K/V into
    blocks 1.. of the pool, so use an engine whose cache is not needed afterwards."""
    from python_backends.engine.batch import SeqChunk
    runner = engine.runner
    batch = runner.prepare([SeqChunk(prompt, 0, list(range(1, 1 + -(-len(prompt) // runner.block_size))), True,
                                     lora_slot)])
    batch.logits_rows = torch.arange(len(prompt), device=runner.device)
    return runner.forward(batch).float()
