"""LoRA output equals PEFT's reference (fp32, same random weights and adapter) on the CPU and, where there is
one, on a CUDA device; and an adapter request never reuses base-model K/V from the prefix cache."""
from __future__ import annotations

import random

import pytest
import torch

from tests.engine.random_llama import engine_on, hf_greedy, hf_model, prefill_logits, run_all

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _adapter(model, path, seed: int):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    cfg = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, lora_dropout=0.0,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, cfg).eval()
    with torch.no_grad():                    # PEFT's non-default init is small: make the adapter matter
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
    peft_model.save_pretrained(str(path))
    return peft_model


@pytest.mark.parametrize("device", DEVICES)
def test_lora_matches_peft_fp32(device, tmp_path):
    pytest.importorskip("peft")
    base = hf_model(device)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 2000) for _ in range(n)] for n in (37, 20, 51)]
    base_ref = [hf_greedy(base, p, 10) for p in prompts]
    adapters = tmp_path / "adapters"
    peft_model = _adapter(base, adapters / "rand", seed=1)
    lora_ref = [hf_greedy(peft_model, p, 10) for p in prompts]
    assert lora_ref != base_ref, "the adapter must change the output for this test to mean anything"
    eng = engine_on(peft_model, tmp_path, device, adapters_dir=str(adapters), max_lora_rank=8)
    # base and adapter requests mixed in one batch, the same prompts under both
    got = run_all(eng, [(p, 10, "rand") for p in prompts] + [(p, 10, "") for p in prompts])
    assert got[:3] == lora_ref
    assert got[3:] == base_ref
    # logits too: teacher-forced prefill under the adapter vs PEFT, within fp32 tolerance
    ours = prefill_logits(eng, prompts[0], eng.lora.acquire("rand"))
    with torch.inference_mode():
        ref = peft_model(torch.tensor([prompts[0]], device=device)).logits[0].float()
    assert (ours - ref).abs().max() < 5e-4        # fp32, different summation order than PEFT's


@pytest.mark.parametrize("device", DEVICES)
def test_adapter_and_prefix_cache(device, tmp_path):
    """A prompt cached under the base model is a miss for an adapter (and vice versa); the adapter's own rerun
    hits; every answer equals the uncached one."""
    pytest.importorskip("peft")
    base = hf_model(device)
    adapters = tmp_path / "adapters"
    peft_model = _adapter(base, adapters / "rand", seed=2)
    eng = engine_on(peft_model, tmp_path, device, adapters_dir=str(adapters), max_lora_rank=8)
    prompt = [random.Random(9).randrange(3, 2000) for _ in range(70)]
    base_ids = run_all(eng, [(prompt, 8, "")])[0]
    s = eng.add_request(prompt, lora_name="rand")
    while eng.has_work():
        eng.step()
    assert s.num_cached_prompt == 0                        # base K/V are not the adapter's
    ada_ids = run_all(eng, [(prompt, 8, "rand")])[0]
    again = eng.add_request(prompt, lora_name="rand")
    while eng.has_work():
        eng.step()
    assert again.num_cached_prompt == 64                   # 4 full blocks of 16, adapter-rooted
    assert ada_ids == hf_greedy(peft_model, prompt, 8)
    with peft_model.disable_adapter():
        assert base_ids == hf_greedy(peft_model, prompt, 8)
