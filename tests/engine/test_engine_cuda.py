"""The engine on a CUDA device (skipped without one): the paged-attention kernel against a plain-torch reference
in fp32 and bf16, fp32 greedy ids equal to transformers' with decode steps replayed from CUDA graphs (padded
buckets, sequences finishing at different steps), sampling on the device, and the KV pool sized from free
memory. Self-contained (random weights): runs as `pytest --noconftest tests/engine/test_engine_cuda.py`."""
from __future__ import annotations

import random

import pytest
import torch

from python_backends.engine.sequence import SamplingParams, Sequence
from tests.engine.random_llama import engine_on, hf_greedy, hf_model, prefill_logits, run_all

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_kernel_matches_reference(dtype, tol):
    from python_backends.engine.paged_attention import paged_attention, reference_attention
    torch.manual_seed(0)
    KV, H, D, bs, nb = 8, 32, 64, 16, 200
    k = torch.randn(KV, nb * bs, D, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    rng = random.Random(0)
    tables = torch.tensor([rng.sample(range(1, nb), 12) for _ in range(5)], device="cuda")
    tok_seq = torch.tensor([0, 1, 2, 3, 3, 3, 4], device="cuda")
    pos = torch.tensor([0, 17, 190, 40, 41, 42, 100], device="cuda")
    q = torch.randn(7, H, D, device="cuda", dtype=dtype)
    got = paged_attention(q, k, v, tables, tok_seq, pos, bs).float()
    ref = reference_attention(q.float(), k.float(), v.float(), tables, tok_seq, pos, bs)
    assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) < tol


def test_greedy_equals_hf_with_cuda_graphs(tmp_path):
    model = hf_model("cuda")
    eng = engine_on(model, tmp_path, "cuda")
    assert eng.runner.graphs is not None and eng.runner.paged
    rng = random.Random(1)
    reqs = [([rng.randrange(3, 2000) for _ in range(n)], g, "") for n, g in ((40, 12), (23, 5), (70, 9), (5, 16), (33, 1))]
    got = run_all(eng, reqs)
    assert eng.runner.graphs.replays > 0
    for (p, g, _), ids in zip(reqs, got):
        assert ids == hf_greedy(model, p, g)
    again = eng.add_request(reqs[2][0], SamplingParams(max_tokens=9, ignore_eos=True))   # prefix-cache hit
    out = []
    while eng.has_work():
        out += [t for o in eng.step() for t in o.token_ids]
    assert again.num_cached_prompt == 64 and out == got[2]


def test_bf16_engine_close_to_fp32_on_cuda(tmp_path):
    """Stated tolerance: bf16 logits within 3 % (relative L2) of fp32's at every position of a 60-token prompt."""
    model = hf_model("cuda")
    prompt = [random.Random(2).randrange(3, 2000) for _ in range(60)]
    l32 = prefill_logits(engine_on(model, tmp_path, "cuda", cuda_graphs=0), prompt)
    l16 = prefill_logits(engine_on(model, tmp_path, "cuda", dtype="bf16", cuda_graphs=0), prompt)
    assert torch.linalg.norm(l16 - l32) / torch.linalg.norm(l32) < 0.03


def test_sampling_on_device():
    from python_backends.engine.sampling import sample
    logits = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]], device="cuda")).expand(2000, -1)
    seqs = [Sequence([1], SamplingParams(temperature=1.0, top_k=3)) for _ in range(2000)]
    assert set(sample(logits.contiguous(), seqs)) == {0, 1, 2}
    a = [sample(logits[:1].contiguous(), [Sequence([1], SamplingParams(temperature=1.0, seed=5))])[0] for _ in range(3)]
    b = [sample(logits[:1].contiguous(), [Sequence([1], SamplingParams(temperature=1.0, seed=5))])[0] for _ in range(3)]
    assert a == b


def test_kv_pool_sized_from_free_memory(tmp_path):
    model = hf_model("cuda")
    free_before = torch.cuda.mem_get_info()[0]
    eng = engine_on(model, tmp_path, "cuda", num_kv_blocks=0, kv_memory_fraction=0.05, cuda_graphs=0)
    expect = int(free_before * 0.05) // eng.runner.kv_bytes_per_block()
    assert 0.9 * expect <= eng.runner.num_blocks <= 1.01 * expect
    assert eng.kv.pool.num_blocks == eng.runner.num_blocks
    assert run_all(eng, [([5, 6, 7, 8] * 10, 4, "")])[0] == hf_greedy(model, [5, 6, 7, 8] * 10, 4)
