"""The two CPU decode-attention implementations agree with a plain fp32 softmax(QK^T)V over each sequence's own
keys (padding masked), and `choose` honours an explicit setting, refuses unknown ones and times `auto` for few rows
and for many; a group runs the choice for its row count."""
from __future__ import annotations

import pytest
import torch

from python_backends.engine import cpu_attention

B, H, KV, D, L = 6, 9, 3, 64, 48


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    rows = []
    for b, n in enumerate(lens):
        kb = k[:, b, :n].float().repeat_interleave(H // KV, 0)          # [H, n, D]
        vb = v[:, b, :n].float().repeat_interleave(H // KV, 0)
        scores = torch.einsum("hd,hnd->hn", q[b].float(), kb) / D ** 0.5
        rows.append(torch.einsum("hn,hnd->hd", torch.softmax(scores, -1), vb).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["sdpa", "matmul"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_matches_the_reference(name, dtype, tolerance):
    gen = torch.Generator().manual_seed(1)
    q = (torch.randn(B, H, D, generator=gen) * 2).to(dtype)
    k = torch.randn(KV, B, L, D, generator=gen).to(dtype)
    v = torch.randn(KV, B, L, D, generator=gen).to(dtype)
    lens = [1, 7, 16, 17, 33, 48]
    k[:, 0, 1:] = 1e4                    # padding holds stale values (finite: the pool zeroes fresh blocks)
    v[:, 0, 1:] = 1e4                    # that must not leak into the result
    mask = (torch.arange(L).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)).view(B, 1, 1, L)
    got = cpu_attention.IMPLEMENTATIONS[name](q, k, v, mask).float()
    want = _reference(q, k, v, lens)
    assert got.shape == (B, H * D)
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < tolerance


def test_choose_honours_explicit_settings_and_times_auto(caplog):
    chosen = cpu_attention.choose("matmul", torch.bfloat16, H, KV, D)
    assert (chosen.few, chosen.many) == ("matmul", "matmul")
    chosen = cpu_attention.choose("sdpa", torch.float32, H, KV, D)
    assert (chosen.few, chosen.many) == ("sdpa", "sdpa")
    chosen = cpu_attention.choose("auto", torch.bfloat16, H, KV, D, torch.device("cuda"))
    assert (chosen.few, chosen.many) == ("sdpa", "sdpa")
    with pytest.raises(ValueError, match="cpu_decode_attention 'fast': allowed are auto, sdpa, matmul"):
        cpu_attention.choose("fast", torch.bfloat16, H, KV, D)
    with caplog.at_level("INFO", logger="python_backends.engine.cpu_attention"):
        chosen = cpu_attention.choose("auto", torch.bfloat16, H, KV, D, rows=4, keys=64, repeats=2)
    assert chosen.few in ("sdpa", "matmul") and chosen.many in ("sdpa", "matmul")
    assert (f"CPU decode attention: {chosen.few} for <= {cpu_attention.FEW_ROWS} rows, {chosen.many} above"
            in caplog.text)
    assert caplog.text.count("sdpa") >= 2 and caplog.text.count("matmul") >= 2       # both timed, both sizes


@pytest.mark.parametrize("rows", [1, cpu_attention.FEW_ROWS, cpu_attention.FEW_ROWS + 1])
def test_the_choice_for_a_group_follows_its_row_count(rows):
    """A group of at most FEW_ROWS rows runs the few-row choice, a larger one the other: same numbers as
    calling that implementation directly."""
    gen = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, H, D, generator=gen)
    k, v = torch.randn(2, KV, rows, 32, D, generator=gen)
    mask = torch.ones(rows, 1, 1, 32, dtype=torch.bool)
    mixed = cpu_attention.DecodeAttention("sdpa", "matmul")
    want = cpu_attention.IMPLEMENTATIONS["sdpa" if rows <= cpu_attention.FEW_ROWS else "matmul"](q, k, v, mask)
    assert torch.equal(mixed(q, k, v, mask), want)


def test_decode_rows_are_grouped_by_length_only_where_it_saves_enough():
    from python_backends.engine.cpu_attention import group_by_length
    assert group_by_length([10, 10, 11, 10]) == [[0, 1, 2, 3]]                       # a burst: one group, in order
    assert group_by_length([2, 40, 3, 41, 2, 39]) == [[3, 1, 5], [2, 0, 4]]          # long first, then short
    assert group_by_length([2, 40, 3, 41], min_saving=1000) == [[0, 1, 2, 3]]        # not worth a group
    groups = group_by_length([1, 20, 40, 60, 80, 100, 120] * 4, min_saving=1)
    assert len(groups) == 3 and sorted(r for g in groups for r in g) == list(range(28))
