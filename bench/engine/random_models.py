"""Random-initialised Hugging Face Llama models for engine benchmarks and tests: the same construction
everywhere (SDPA attention, EOS switched off so every row runs to max_new_tokens, fixed seed)."""
from __future__ import annotations

import torch


def random_hf_llama(config: dict, device: torch.device | str, dtype: torch.dtype = torch.float32, seed: int = 0,
                    max_positions: int = 4096):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**config, max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None          # EOS ignored: every row runs to max_new_tokens
    model.generation_config.pad_token_id = 0
    return model
