"""The fused CPU kernels (python_backends/engine/cpu_kernels.py) against the torch ops they replace: fp32 to
within float rounding, greedy argmax exactly, bf16 with the same roundings (at most 1 bf16 ulp apart, and in few elements); decode
attention reads each row's own blocks in place and equals softmax(QK^T)V over exactly its keys; bad indices
are refused with an error naming them, never read; an engine with the kernels gives the greedy ids of one
without them (fp32), prefill, decode and prefix-cache hits alike."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from python_backends.engine import cpu_kernels
from python_backends.engine.sequence import SamplingParams
from tests.engine.conftest import random_prompt, run_to_end

K = cpu_kernels.load()
pytestmark = pytest.mark.skipif(K is None, reason="the fused CPU kernels could not be built on this machine")
H, KV, D, BS = 9, 3, 64, 16
DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: float rounding only; bf16: the same roundings, so any difference is one ulp and rare (a
    reduction's order differs, which may move a value across a rounding boundary)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    diff = (got.float() - want.float()).abs()
    ulp = want.float().abs().clamp_min(1e-30) * 2 ** -7
    assert (diff <= ulp * 1.01 + 1e-30).all(), diff.max()
    assert (diff > 0).float().mean() < 0.02


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:       # ModelRunner._rms
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 576), (33, 576), (5, 100)])     # 100: not a multiple of 16
def test_norms_match_torch(dtype, rows, width):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    y = torch.randn(rows, width, generator=gen).to(dtype)
    w = torch.randn(width, generator=gen).to(dtype)
    _close(K.rms_norm(x, w, 1e-5), _rms(x, w, 1e-5), dtype)
    x2 = x.clone()
    h = K.add_rms_norm(x2, y, w, 1e-5)
    assert torch.equal(x2, x + y)                         # the residual add, in place, rounded as torch's
    _close(h, _rms(x + y, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 40])
def test_silu_mul_matches_torch(dtype, inter):
    gu = (torch.randn(7, 2 * inter, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0])        # saturated and zero gates
    _close(K.silu_mul(gu), F.silu(gu[:, :inter]) * gu[:, inter:], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_and_k_in_place_and_writes_kv_at_the_slots(dtype):
    gen = torch.Generator().manual_seed(3)
    T, P, S = 6, 64, 8 * BS
    qkv = torch.randn(T, (H + 2 * KV) * D, generator=gen).to(dtype)
    angles = torch.rand(P, D // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    pos = torch.tensor([0, 5, 6, 7, 63, 1])
    slots = torch.tensor([17, 3, 100, 101, 127, 0])
    kc, vc = torch.zeros(KV, S, D, dtype=dtype), torch.zeros(KV, S, D, dtype=dtype)
    before = qkv.clone()
    K.rope_write_kv(qkv, cos, sin, pos, kc, vc, slots, H, KV)

    x = before[:, :(H + KV) * D].view(T, H + KV, D)       # ModelRunner._rope
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    want = x * c + torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1) * s
    _close(qkv[:, :(H + KV) * D].view(T, H + KV, D), want, dtype)
    assert torch.equal(qkv[:, (H + KV) * D:], before[:, (H + KV) * D:])            # v untouched
    assert torch.equal(kc[:, slots].transpose(0, 1), qkv[:, H * D:(H + KV) * D].view(T, KV, D))
    assert torch.equal(vc[:, slots].transpose(0, 1), before[:, (H + KV) * D:].view(T, KV, D))
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert (kc[:, untouched] == 0).all() and (vc[:, untouched] == 0).all()


def _attention_reference(q, kc, vc, tables, lens, d, heads=H, block_size=BS):
    kv = kc.shape[0]
    rows = []
    for b, n in enumerate(lens):
        slots = torch.tensor([tables[b][t // block_size] * block_size + t % block_size for t in range(n)])
        k = kc[:, slots].float().repeat_interleave(heads // kv, 0)                   # [H, n, D]
        v = vc[:, slots].float().repeat_interleave(heads // kv, 0)
        scores = torch.einsum("hd,hnd->hn", q[b].view(heads, d).float(), k) / d ** 0.5
        rows.append(torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), v).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 4e-3)])
@pytest.mark.parametrize("head_dim", [64, 128, 48])       # 48: the portable path
def test_decode_attention_reads_each_rows_blocks_in_place(dtype, tolerance, head_dim):
    gen = torch.Generator().manual_seed(4)
    d, blocks = head_dim, 40
    kc = torch.randn(KV, blocks * BS, d, generator=gen).to(dtype)
    vc = torch.randn(KV, blocks * BS, d, generator=gen).to(dtype)
    lens = [1, 16, 17, 50, 200, 3]
    order = torch.randperm(blocks - 1, generator=gen).add(1).tolist()
    tables, at = [], 0
    for n in lens:
        nb = -(-n // BS)
        tables.append(order[at:at + nb])
        at = (at + nb) % (blocks - 14)
    width = max(len(t) for t in tables) + 2                 # wider than any row needs: padding is never read
    padded = torch.tensor([t + [blocks + 999] * (width - len(t)) for t in tables])
    qkv = torch.randn(len(lens), (H + 2 * KV) * d, generator=gen).to(dtype)
    q = qkv[:, :H * d]                                      # strided rows, as the engine passes them
    got = K.decode_attention(q, kc, vc, padded, torch.tensor(lens), BS, d ** -0.5)
    want = _attention_reference(q, kc, vc, tables, lens, d)
    assert got.shape == (len(lens), H * d) and got.dtype == dtype
    assert ((got.float() - want).norm() / want.norm()).item() < tolerance


@pytest.mark.parametrize("heads, kv_heads, block_size, head_dim", [
    (9, 3, 16, 64),       # SmolLM2: 3 query heads per K/V head
    (32, 4, 32, 128),     # 8 per K/V head (Llama-3), two 16-key tiles per block
    (16, 1, 16, 64),      # 16 per K/V head: a whole AMX tile of heads
    (34, 2, 16, 64),      # 17 per K/V head: more than one tile holds (the AVX-512 scores)
    (8, 2, 8, 64),        # blocks of 8 keys: not whole tiles (the AVX-512 scores)
])
def test_decode_attention_bf16_shapes_and_unwritten_slots(heads, kv_heads, block_size, head_dim):
    """bf16 decode attention for the GQA ratios and block sizes the engine meets (AMX scores where the CPU has
    tiles and the shape allows, AVX-512 elsewhere: the same answer); a block's slots past a row's length hold
    NaN here (a freed sequence's leftovers may be anything) and never reach the output."""
    gen = torch.Generator().manual_seed(heads * block_size)
    blocks, d = 24, head_dim
    kc = torch.randn(kv_heads, blocks * block_size, d, generator=gen).to(torch.bfloat16)
    vc = torch.randn(kv_heads, blocks * block_size, d, generator=gen).to(torch.bfloat16)
    lens = [1, block_size + 1, 3 * block_size - 5, 70]
    order = torch.randperm(blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(order[at:at + nb])
        at += nb
        last = tables[-1][-1] * block_size
        for cache in (kc, vc):
            cache[:, last + (n - 1) % block_size + 1:last + block_size] = float("nan")
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), heads * d, generator=gen).to(torch.bfloat16)
    got = K.decode_attention(q, kc, vc, padded, torch.tensor(lens), block_size, d ** -0.5)
    want = _attention_reference(q, kc, vc, tables, lens, d, heads, block_size)
    assert got.isfinite().all()
    assert ((got.float() - want).norm() / want.norm()).item() < 4e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 33, 5])        # vector loop + tail, and the scalar loop alone
def test_argmax_rows_gives_torch_max_indices(dtype, vocab):
    """The first maximum of each row (ties, the last column, -inf, NaN) as torch's max(dim=-1).indices."""
    x = torch.randn(8, vocab, generator=torch.Generator().manual_seed(6)).to(dtype)
    x[1, 0] = x[1, vocab - 1] = 50.0                      # tie: the first wins
    x[2, vocab - 1] = 60.0                                # the tail
    x[3] = float("-inf")
    x[4, vocab // 2] = x[4, vocab - 1] = float("nan")     # a NaN is the maximum, the first NaN
    x[5, vocab - 1] = float("nan")
    x[6, 0] = float("nan")
    x[7] = 1.0                                            # all equal
    assert torch.equal(K.argmax_rows(x), x.max(dim=-1).indices)
    assert torch.equal(K.argmax_rows(x[:, :vocab - 1]), x[:, :vocab - 1].max(dim=-1).indices)  # strided rows


def test_bad_indices_are_refused_not_read():
    kc = torch.zeros(KV, 4 * BS, D)
    q = torch.zeros(2, H * D)
    ok = torch.tensor([[1, 2], [3, 0]])
    with pytest.raises(RuntimeError, match="row 1: block id outside the pool"):
        K.decode_attention(q, kc, kc, torch.tensor([[1, 2], [4, 0]]), torch.tensor([20, 5]), BS, 0.125)
    with pytest.raises(RuntimeError, match="row 0: length 33 outside its block table"):
        K.decode_attention(q, kc, kc, ok, torch.tensor([33, 5]), BS, 0.125)
    with pytest.raises(RuntimeError, match="row 1: length 0 outside its block table"):
        K.decode_attention(q, kc, kc, ok, torch.tensor([3, 0]), BS, 0.125)
    qkv = torch.zeros(1, (H + 2 * KV) * D)
    table = torch.zeros(8, D)
    with pytest.raises(RuntimeError, match="slot 64 outside the KV pool"):
        K.rope_write_kv(qkv, table, table, torch.tensor([0]), kc, kc.clone(), torch.tensor([64]), H, KV)
    with pytest.raises(RuntimeError, match="position 8 outside the RoPE table"):
        K.rope_write_kv(qkv, table, table, torch.tensor([8]), kc, kc.clone(), torch.tensor([0]), H, KV)
    with pytest.raises(RuntimeError, match="k_cache, v_cache: contiguous .KV, S, D., same shape and dtype"):
        K.rope_write_kv(qkv, table, table, torch.tensor([0]), kc, kc[:, :BS].clone(), torch.tensor([0]), H, KV)
    with pytest.raises(RuntimeError, match="float32 or bfloat16|expected scalar type|not implemented"):
        K.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64), 1e-5)


def test_settings_are_checked():
    cpu = torch.device("cpu")
    assert cpu_kernels.resolve("off", cpu) is None
    assert cpu_kernels.resolve("auto", cpu) is K and cpu_kernels.resolve("on", cpu) is K
    assert cpu_kernels.resolve("auto", torch.device("cuda")) is None      # never on CUDA
    with pytest.raises(ValueError, match="cpu_kernels 'fast': allowed are auto, on, off"):
        cpu_kernels.resolve("fast", cpu)


def test_engine_with_kernels_gives_the_greedy_ids_of_torch_ops(make_engine):
    """fp32: long and short prompts (chunked prefill beside decodes), then the same prompts again (prefix-cache
    hits: decode over cached blocks), with and without the kernels."""
    rng = random.Random(5)
    shared = random_prompt(rng, 40)
    prompts = [random_prompt(rng, n) for n in (3, 17, 300)] + [shared + random_prompt(rng, 9), shared]

    def generate(**settings):
        engine = make_engine(max_num_batched_tokens=64, **settings)
        assert (engine.runner.kernels is not None) == (settings["cpu_kernels"] == "on")
        ids = []
        for _ in range(2):
            seqs = [engine.add_request(p, _greedy(12)) for p in prompts]
            results = run_to_end(engine)
            ids.append([results[s.seq_id]["ids"] for s in seqs])
        return ids

    with_kernels, without = generate(cpu_kernels="on"), generate(cpu_kernels="off")
    assert with_kernels == without
    assert all(len(ids) == 12 for ids in with_kernels[0])


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
