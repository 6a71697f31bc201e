"""Prefix cache keys: chains rooted at the LoRA adapter (engine and router compute the same hashes), and full
blocks of generated tokens are cached, so a chat follow-up that resends the history hits the cache."""
from __future__ import annotations

import random

from common.hashing import prefix_block_hashes, root_hash
from python_backends.engine.sequence import SamplingParams
from tests.engine.conftest import random_prompt, run_to_end


def test_adapter_roots_the_chain():
    ids = list(range(100, 148))
    base, a, b = (prefix_block_hashes(ids, 16, name) for name in ("", "french", "terse-json"))
    assert len(base) == len(a) == 3
    assert not set(base) & set(a) and not set(a) & set(b)
    assert root_hash("") == 0 and root_hash("french") == root_hash("french") != root_hash("terse-json")
    assert prefix_block_hashes(ids, 16) == base                 # the base model's hashes are unchanged


def test_engine_registers_the_hashes_the_router_computes(make_engine):
    eng = make_engine()
    prompt = random_prompt(random.Random(4), 50)
    seq = eng.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), lora_name="french")
    run_to_end(eng)
    assert set(prefix_block_hashes(prompt, 16, "french")) <= set(eng.kv.pool.cached_hashes())
    assert seq.block_hashes[:3] == prefix_block_hashes(prompt, 16, "french")


def test_generated_blocks_are_cached_for_follow_ups(make_engine):
    eng = make_engine()
    prompt = random_prompt(random.Random(5), 40)
    first = eng.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    out = run_to_end(eng)[first.seq_id]["ids"]
    history = prompt + out                                      # 80 tokens: 5 full blocks, 3 past the prompt's
    follow = eng.add_request(history + random_prompt(random.Random(6), 9), SamplingParams(max_tokens=4))
    run_to_end(eng)
    assert follow.num_cached_prompt >= 16 * ((len(prompt) + len(out) - 1) // 16)   # generated blocks included
