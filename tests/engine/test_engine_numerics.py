"""Numerics and machine facts the fast paths rely on: bf16 agrees with fp32 within a stated tolerance (for each
CPU GEMM kind), Llama-3 RoPE scaling equals transformers', the CUDA paged-attention kernel
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
from python_backends.engine import cpu_kernels, device
from python_backends.engine.device import (PackedLinear, cpu_has_bf16_units, cpu_matmul_kind, fbgemm_available,
                                           kv_blocks_for_memory, resolve_device)
from tests.engine.conftest import CHAT
from tests.engine.random_llama import prefill_logits


def _prompt(tokenizer) -> list[int]:
    return tokenizer.encode(CHAT.format("Explain in two sentences why the sky is blue, then name three colours.")).ids


@pytest.mark.parametrize("matmul, gemm", [("bf16", "onednn"), ("bf16", "kernel"), ("fp16", "auto")])
def test_bf16_within_tolerance_of_fp32(make_engine, tokenizer, matmul, gemm):
    """Stated tolerance, SmolLM2-135M, teacher-forced logits at every prompt position: relative L2 error of
    bf16 weights vs fp32 under 5 % (bf16 activations; oneDNN's GEMMs or the fused kernels') or 0.1 %
    (fp16-packed weights, fp32 activations: the weights are the same numbers, only the summation order
    differs), and the top-1 token agrees at >= 90 % (99 %) of the positions."""
    if matmul == "fp16" and not fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    if gemm == "kernel" and cpu_kernels.load() is None:
        pytest.skip("the fused CPU kernels could not be built on this machine")
    prompt = _prompt(tokenizer)
    ref = prefill_logits(make_engine(), prompt)
    got = prefill_logits(make_engine(dtype="bf16", cpu_matmul=matmul, cpu_bf16_gemm=gemm), prompt)
    error, agree = {"bf16": (0.05, 0.9), "fp16": (0.001, 0.99)}[matmul]
    assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) < error
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= agree


def test_int8_weights_within_tolerance_of_fp32(make_engine, tokenizer, monkeypatch):
    """cpu_matmul int8 (opt-in, lossy): with every GEMM forced through the int8 weights (in serving only steps
    of <= INT8_MAX_ROWS rows are), teacher-forced logits stay within 10 % relative L2 of fp32 and the top-1
    token agrees at >= 85 % of the positions (measured: 94.5 % over 16 chat prompts x 16 positions; bf16 97.7 %)."""
    if not cpu_has_bf16_units():
        pytest.skip("cpu_matmul int8 needs bf16 units")
    prompt = _prompt(tokenizer)
    ref = prefill_logits(make_engine(), prompt)
    monkeypatch.setattr(device, "INT8_MAX_ROWS", 1 << 20)
    got = prefill_logits(make_engine(dtype="bf16", cpu_matmul="int8"), prompt)
    assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) < 0.10
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("rows", [1, 4, 5, 32])
def test_int8_packed_linear_uses_int8_weights_for_few_rows_only(rows):
    """Up to INT8_MAX_ROWS rows: the product with the int8 weights times their per-row scales (to bf16
    rounding); more rows: exactly the bf16 packed product."""
    if not cpu_has_bf16_units():
        pytest.skip("cpu_matmul int8 needs bf16 units")
    torch.manual_seed(rows)
    w = (torch.randn(960, 576) * 0.05).to(torch.bfloat16)
    packed = PackedLinear.pack(w, "int8")
    x = torch.randn(rows, 576).to(torch.bfloat16)
    q, scales = device.int8_per_row(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    if rows <= device.INT8_MAX_ROWS:
        ref = torch.nn.functional.linear(x.float(), q.float() * scales.float()[:, None])
        assert torch.allclose(packed(x).float(), ref, rtol=0.02, atol=0.02)
        assert not torch.equal(packed(x), torch.nn.functional.linear(x, w))
    else:
        assert torch.equal(packed(x), torch.nn.functional.linear(x, w))


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
    torch.manual_seed(rows)
    w = torch.randn(960, 576).to(torch.bfloat16)
    packed = PackedLinear.pack(w)
    if packed is None:
        pytest.skip("this torch build has no oneDNN linear")
    x = torch.randn(rows, 576).to(torch.bfloat16)
    assert torch.equal(packed(x), torch.nn.functional.linear(x, w))
    assert PackedLinear.pack(w.float()) is None


@pytest.mark.parametrize("rows", [1, 4, 33])
def test_fp16_packed_linear_equals_fp32_product_of_the_bf16_weights(rows):
    """fbgemm's fp16-packed weights hold a bf16 weight exactly, so the product is F.linear's in fp32 up to the
    summation order."""
    if not fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    torch.manual_seed(rows)
    w = (torch.randn(960, 576) * 0.05).to(torch.bfloat16)
    packed = PackedLinear.pack(w, "fp16")
    x = torch.randn(rows, 576)
    got, ref = packed(x), torch.nn.functional.linear(x, w.float())
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_cpu_bf16_detection_reads_the_flags(tmp_path):
    without = tmp_path / "cpuinfo"
    without.write_text("flags\t: fpu sse2 avx2 avx512f\n")
    with_bf16 = tmp_path / "cpuinfo-bf16"
    with_bf16.write_text("flags\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    avx512 = "AVX512" in torch.backends.cpu.get_cpu_capability()
    assert cpu_has_bf16_units.__wrapped__(str(without)) is False
    assert cpu_has_bf16_units.__wrapped__(str(with_bf16)) is avx512
    # auto: bf16 GEMMs where bf16 units exist, else fbgemm's fp16-packed weights; explicit kinds pass through;
    # fp32 models and CUDA are not asked
    cpu = torch.device("cpu")
    auto = cpu_matmul_kind("auto", torch.bfloat16, cpu)
    assert auto == ("bf16" if cpu_has_bf16_units() else "fp16" if fbgemm_available() else "fp32")
    assert cpu_matmul_kind("fp32", torch.bfloat16, cpu) == "fp32"
    assert cpu_matmul_kind("auto", torch.float32, cpu) == ""
    assert cpu_matmul_kind("auto", torch.bfloat16, torch.device("cuda")) == ""
    with pytest.raises(ValueError, match="allowed are auto, bf16, fp16, fp32, int8"):
        cpu_matmul_kind("int4", torch.bfloat16, cpu)
    if cpu_has_bf16_units():
        assert cpu_matmul_kind("int8", torch.bfloat16, cpu) == "int8"
    else:
        with pytest.raises(ValueError, match="int8' needs a CPU with bf16 units"):
            cpu_matmul_kind("int8", torch.bfloat16, cpu)


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
