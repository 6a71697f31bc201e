"""Fixtures for the engine tests: fp32 engines on the real SmolLM2 weights, built once per session, and a
transformers reference for greedy ids. Helpers drive an engine step by step and collect its outputs."""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from common.settings import REPO_ROOT

ADAPTERS_DIR = REPO_ROOT / "adapters" / "smollm2-135m"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def run_to_end(engine, max_steps: int = 5000, on_step: Callable | None = None) -> dict[int, dict]:
    """Step until idle; per seq_id: released ids, finish reason, usage."""
    results: dict[int, dict] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for out in engine.step():
            r = results.setdefault(out.seq.seq_id, {"ids": [], "finish": "", "usage": None, "seq": out.seq})
            r["ids"].extend(out.token_ids)
            if out.finished:
                r["finish"], r["usage"] = out.finish_reason, out.usage
        if on_step:
            on_step(engine)
    assert not engine.has_work(), "engine did not drain"
    return results


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


@pytest.fixture(scope="session")
def make_engine(smollm2_dir: Path):
    """Factory: an fp32 LLMEngine with config overrides (weights load in ~1 s)."""
    from python_backends.engine.config import EngineConfig
    from python_backends.engine.engine import LLMEngine

    def make(**overrides):
        cfg = dict(weights_dir=str(smollm2_dir), adapters_dir=str(ADAPTERS_DIR), dtype="fp32",
                   num_kv_blocks=1024, max_num_batched_tokens=128, max_context=2048, threads=1)
        cfg.update(overrides)
        return LLMEngine(EngineConfig(**cfg))
    return make


@pytest.fixture(scope="session")
def engine(make_engine):
    return make_engine()


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def hf_greedy(smollm2_dir: Path):
    """transformers' greedy `generate` in fp32 on the same weights: prompt ids -> new ids."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)   # the cores are shared: one thread never waits at a barrier for a preempted peer
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    cache: dict[tuple, list[int]] = {}

    def generate(prompt_ids: list[int], n: int) -> list[int]:
        key = (tuple(prompt_ids), n)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
            cache[key] = out[0, len(prompt_ids):].tolist()
        return cache[key]
    return generate
