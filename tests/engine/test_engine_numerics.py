"""Numerics and machine facts the fast paths rely on: bf16 agrees with fp32 within a stated tolerance (with and
without the fp32 weight copies), Llama-3 RoPE scaling equals transformers', the CUDA paged-attention kernel
reproduces transformers' greedy ids when run by Triton's CPU interpreter, the CPU bf16 detection reads the
flags, and the KV pool is sized from free memory."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from common.settings import REPO_ROOT
from python_backends.engine.device import cpu_has_bf16_units, fp32_matmul_rows, kv_blocks_for_memory, resolve_device
from tests.engine.conftest import CHAT
from tests.engine.random_llama import prefill_logits


def _prompt(tokenizer) -> list[int]:
    return tokenizer.encode(CHAT.format("Explain in two sentences why the sky is blue, then name three colours.")).ids


@pytest.mark.parametrize("fp32_rows", [0, 16])
def test_bf16_within_tolerance_of_fp32(make_engine, tokenizer, fp32_rows):
    """Stated tolerance, SmolLM2-135M, teacher-forced logits at every prompt position: relative L2 error of
    bf16 vs fp32 under 5 %, and the top-1 token agrees at >= 90 % of the positions."""
    prompt = _prompt(tokenizer)
    ref = prefill_logits(make_engine(), prompt)
    got = prefill_logits(make_engine(dtype="bf16", fp32_matmul_min_tokens=fp32_rows), prompt)
    assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) < 0.05
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from python_backends.engine.rope import inverse_frequencies
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, rope_theta=500000.0,
                      max_position_embeddings=131072,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inverse_frequencies(cfg.to_dict(), 64)
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0)
    plain = inverse_frequencies({"rope_theta": 500000.0}, 64)
    assert not torch.allclose(ours, plain)                     # the scaling really changes the low frequencies


def test_paged_kernel_reproduces_transformers_in_triton_interpreter():
    """The CUDA attention path (one paged-attention Triton kernel per layer for decode rows and prefill chunks
    alike), run by Triton's interpreter on the CPU: fp32 greedy ids equal transformers', chunked prefill and
    mixed steps included (bf16 dots are not emulated by the interpreter; the CUDA tests cover them)."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import random, tempfile, torch
        from pathlib import Path
        from tests.engine.random_llama import engine_on, hf_greedy, hf_model, run_all
        model = hf_model("cpu")
        eng = engine_on(model, Path(tempfile.mkdtemp()), "cpu", max_num_batched_tokens=24)
        eng.runner.paged = True                       # the CUDA attention path, on CPU tensors
        rng = random.Random(3)
        reqs = [([rng.randrange(3, 2000) for _ in range(n)], g, "") for n, g in ((30, 6), (11, 4), (45, 5))]
        got = run_all(eng, reqs)
        assert got == [hf_greedy(model, p, g) for p, g, _ in reqs], got
        print("OK")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("use_dot", [True, False])
def test_both_paged_attention_kernels_match_the_reference_in_the_triton_interpreter(use_dot):
    """The tensor-core kernel and its multiply-add fallback (shared helpers: query load, block-table walk,
    online softmax) against the plain-torch reference, fp32, on CPU tensors through Triton's interpreter."""
    pytest.importorskip("triton")
    script = textwrap.dedent(f"""
        import random, torch
        from python_backends.engine import paged_attention as pa
        pa._use_dot = {use_dot}
        torch.manual_seed(0)
        KV, H, D, bs, nb = 2, 6, 16, 4, 40
        k, v = torch.randn(KV, nb * bs, D), torch.randn(KV, nb * bs, D)
        rng = random.Random(0)
        tables = torch.tensor([rng.sample(range(1, nb), 10) for _ in range(3)])
        tok_seq, pos = torch.tensor([0, 1, 1, 2]), torch.tensor([0, 9, 10, 37])
        q = torch.randn(4, H, D)
        got = pa.paged_attention(q, k, v, tables, tok_seq, pos, bs)
        ref = pa.reference_attention(q, k, v, tables, tok_seq, pos, bs)
        assert pa._use_dot == {use_dot}, "the kernel under test failed and fell back"
        err = float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))
        assert err < 1e-5, err
        print("OK", err)
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("rows", [1, 7, 32, 200])
def test_packed_cpu_linear_is_bit_identical_to_f_linear(rows):
    """oneDNN-packed bf16 weights (device.PackedLinear) give exactly F.linear's products, for any row count
    (the packing is laid out for 32 rows), and fp32 weights are left unpacked."""
    from python_backends.engine.device import PackedLinear
    torch.manual_seed(rows)
    w = torch.randn(960, 576).to(torch.bfloat16)
    packed = PackedLinear.pack(w)
    if packed is None:
        pytest.skip("this torch build has no oneDNN linear")
    x = torch.randn(rows, 576).to(torch.bfloat16)
    assert torch.equal(packed(x), torch.nn.functional.linear(x, w))
    assert PackedLinear.pack(w.float()) is None


def test_cpu_bf16_detection_reads_the_flags(tmp_path):
    without = tmp_path / "cpuinfo"
    without.write_text("flags\t: fpu sse2 avx2 avx512f\n")
    with_bf16 = tmp_path / "cpuinfo-bf16"
    with_bf16.write_text("flags\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    avx512 = "AVX512" in torch.backends.cpu.get_cpu_capability()
    assert cpu_has_bf16_units.__wrapped__(str(without)) is False
    assert cpu_has_bf16_units.__wrapped__(str(with_bf16)) is avx512
    # auto (-1): no fp32 copies where bf16 units exist; explicit values and non-bf16 dtypes pass through
    auto = fp32_matmul_rows(-1, torch.bfloat16, torch.device("cpu"))
    assert auto == (0 if cpu_has_bf16_units() else 16)
    assert fp32_matmul_rows(32, torch.bfloat16, torch.device("cpu")) == 32
    assert fp32_matmul_rows(-1, torch.float32, torch.device("cpu")) == 0


def test_kv_pool_sizing_and_device_errors():
    blocks = kv_blocks_for_memory(0.01, 1 << 20, torch.device("cpu"))
    assert blocks >= 2
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        kv_blocks_for_memory(1.5, 1 << 20, torch.device("cpu"))
    with pytest.raises(ValueError, match="allowed are cpu, cuda"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_unwritten_pool_memory_never_reaches_outputs(tmp_path):
    """The pool comes from torch.empty: poison it with NaN (block 0, the padding block, excepted) and the CPU
    path still reproduces transformers' greedy ids in a mixed batch (whole-block reads mask unwritten slots)."""
    import random

    from tests.engine.random_llama import engine_on, hf_greedy, hf_model, run_all
    model = hf_model("cpu")
    eng = engine_on(model, tmp_path, "cpu", max_num_batched_tokens=24)
    bs = eng.runner.block_size
    for cache in (eng.runner.k_cache, eng.runner.v_cache):
        cache[:, :, bs:].fill_(float("nan"))
    rng = random.Random(8)
    reqs = [([rng.randrange(3, 2000) for _ in range(n)], g, "") for n, g in ((30, 6), (11, 9), (45, 5))]
    assert run_all(eng, reqs) == [hf_greedy(model, p, g) for p, g, _ in reqs]
