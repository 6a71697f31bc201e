"""The fused kernels' bf16 linear (csrc/cpu_gemm.cpp) and the start-up choice between it and oneDNN
(device.choose_bf16_gemm): products and sums in fp32 as the reference's, the output rounded to bf16 as torch
rounds (within one bf16 ulp of the fp32 product rounded once, for any row count, column count and odd K);
NaN and inf stay in their rows; a weight packed for one shape is refused for another, with an error saying
what does not match; the setting is checked."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from python_backends.engine import cpu_kernels
from python_backends.engine.device import PackedLinear, choose_bf16_gemm

K = cpu_kernels.load()
pytestmark = pytest.mark.skipif(K is None, reason="the fused CPU kernels could not be built on this machine")


def _within_one_ulp(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got (bf16) vs x @ w^T in fp64 rounded to bf16 once: the kernel's fp32 sums differ from it only by
    float rounding, so every element is within one bf16 ulp of the reference (plus fp32 noise near zero)."""
    exact = x.double() @ w.double().T
    want = exact.to(torch.bfloat16).double()
    ulp = want.abs() * 2 ** -7 + exact.abs().amax() * 1e-6
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.double() - want).abs() <= ulp).all()


@pytest.mark.parametrize("rows, out_features, in_features", [
    (1, 576, 576),       # one decoding stream
    (32, 960, 576),      # a 32-row decode step, the fused qkv
    (7, 100, 64),        # columns not a multiple of 16 (the last block is partly padding)
    (13, 50, 33),        # odd K: the last k pair is half padding
    (70, 64, 1536),      # more rows than one micro-kernel call, the down projection's K
    (3, 4099, 96),       # many column blocks and a ragged tail
    # from 7 rows on, AMX tiles where the CPU has them (K a multiple of 32): 16-row tiles, ragged rows and
    # columns, an odd number of column blocks, two tiles of rows and more
    (16, 48, 64),
    (17, 33, 96),
    (45, 4099, 576),
    (7, 200, 1536),
    (130, 96, 64),
])
def test_linear_matches_the_fp32_product(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * out_features)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    packed = K.pack_linear_weight(w)
    got = K.linear_packed(x, packed, out_features)
    _within_one_ulp(got, x, w)
    # and close to oneDNN's bf16 product (both fp32 sums; their order differs)
    assert ((got.float() - F.linear(x, w).float()).abs() <= F.linear(x, w).float().abs() * 2 ** -6 + 1e-3).all()


def test_strided_rows_and_empty_batches():
    w = torch.randn(48, 64).to(torch.bfloat16)
    packed = K.pack_linear_weight(w)
    for rows in (5, 24):                                 # the FMA path, and AMX tiles where there are
        wide = torch.randn(rows, 128).to(torch.bfloat16)
        x = wide[:, ::2]                                 # rows not contiguous
        _within_one_ulp(K.linear_packed(x, packed, 48), x, w)
    assert K.linear_packed(torch.empty(0, 64, dtype=torch.bfloat16), packed, 48).shape == (0, 48)


@pytest.mark.parametrize("rows, in_features", [(3, 32), (20, 64)])    # 20 x 64: AMX tiles where there are
def test_nan_and_inf_stay_in_their_rows(rows, in_features):
    w = torch.randn(40, in_features).to(torch.bfloat16)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    y = K.linear_packed(x, K.pack_linear_weight(w), 40)
    assert y[0].isnan().all()
    assert (y[1].isinf() | y[1].isnan()).all()           # inf times a weight of either sign (or 0: NaN)
    assert y[2:].isfinite().all()


def test_an_odd_k_never_reads_the_next_rows_values():
    """K = 31 packs to 16 k pairs (one AMX tile's worth): the kernel must still not read x past each row's 31
    values, or a NaN at the start of row 3 would reach row 2."""
    w = torch.randn(40, 31).to(torch.bfloat16)
    x = torch.randn(20, 31).to(torch.bfloat16)
    x[3, 0] = float("nan")
    y = K.linear_packed(x, K.pack_linear_weight(w), 40)
    assert y[3].isnan().all() and y[torch.arange(20) != 3].isfinite().all()
    _within_one_ulp(y[4:], x[4:], w)


def test_mismatched_inputs_are_refused():
    w = torch.randn(40, 32).to(torch.bfloat16)
    packed = K.pack_linear_weight(w)
    x = torch.randn(2, 32).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="x has 30 columns; the packed weight was made for 31 or 32"):
        K.linear_packed(torch.randn(2, 30).to(torch.bfloat16), packed, 40)
    with pytest.raises(RuntimeError, match="n = 60 does not match the packed weight's 3 column blocks"):
        K.linear_packed(x, packed, 60)
    with pytest.raises(RuntimeError, match="x must be a 2-D bf16 CPU tensor"):
        K.linear_packed(x.float(), packed, 40)
    with pytest.raises(RuntimeError, match="packed weight must come from pack_linear_weight"):
        K.linear_packed(x, w, 40)
    with pytest.raises(RuntimeError, match="weight must be a 2-D bf16 CPU tensor"):
        K.pack_linear_weight(w.float())


def test_packed_linear_with_the_kernel_and_the_choice():
    w = (torch.randn(96, 64) * 0.1).to(torch.bfloat16)
    linear = PackedLinear.pack(w, "bf16", 8, gemm=K)
    x = torch.randn(8, 64).to(torch.bfloat16)
    assert linear.gemm is K and torch.equal(linear(x), K.linear_packed(x, K.pack_linear_weight(w), 96))
    assert choose_bf16_gemm("auto", K, w, 8) in ("kernel", "onednn")     # timed: either may win on a CPU
    assert choose_bf16_gemm("kernel", K, w, 8) == "kernel"
    assert choose_bf16_gemm("onednn", K, w, 8) == "onednn"
    assert choose_bf16_gemm("auto", None, w, 8) == "onednn"
    assert choose_bf16_gemm("kernel", K, None, 8) == "onednn"           # no bf16 GEMMs in this model
    with pytest.raises(ValueError, match="cpu_bf16_gemm 'fast': allowed are auto, kernel, onednn"):
        choose_bf16_gemm("fast", K, w, 8)
    with pytest.raises(ValueError, match="cpu_bf16_gemm 'kernel' needs the fused CPU kernels"):
        choose_bf16_gemm("kernel", None, w, 8)
