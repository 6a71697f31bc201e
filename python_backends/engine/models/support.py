"""What the engine serves: the allow-list of architectures and config features, checked without torch.

`build-engines` calls `check_config` before any work (a refused checkpoint never gets a registry row) and the
engine calls it again when it loads weights, so a folder copied in by hand is refused at load, not served wrong.
Every refusal names the config field, its value and what is supported.
"""
from __future__ import annotations

from typing import Any

# architecture (config.json `architectures[0]`) -> (module under python_backends.engine.models, class)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaModel"),
    "MistralForCausalLM": ("mistral", "MistralModel"),
    "Qwen2ForCausalLM": ("qwen", "Qwen2Model"),
    "Qwen3ForCausalLM": ("qwen", "Qwen3Model"),
    "GemmaForCausalLM": ("gemma", "GemmaModel"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2Model"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3Model"),
    "Phi3ForCausalLM": ("phi3", "Phi3Model"),
}
# GGUF `general.architecture` -> the Hugging Face architecture transformers converts it to
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                      "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
# config.json `model_type` -> architecture, for configs without `architectures` (AutoModelForCausalLM's mapping)
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
               "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
WHY_NOT = {  # refused families that users try first, with the reason
    "GPT2LMHeadModel": "GPT-2 uses learned absolute positions, LayerNorm and a fused c_attn Conv1D",
    "GPTNeoXForCausalLM": "GPT-NeoX uses LayerNorm, parallel attention/MLP residuals and partial rotary",
    "gpt2": "GPT-2 uses learned absolute positions, LayerNorm and a fused c_attn Conv1D",
    "gpt_neox": "GPT-NeoX uses LayerNorm, parallel attention/MLP residuals and partial rotary",
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 (4B and up) wraps the text model in a vision "
                                      "model; convert its text model (Gemma3ForCausalLM) instead",
}
ROPE_TYPES = ("default", "llama3", "linear")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModel(ValueError):
    """A checkpoint the engine would serve wrong; `field` names the config field at fault."""

    def __init__(self, field: str, value: Any, supported: str) -> None:
        super().__init__(f"config.json {field}={value!r} is not supported by the engine; supported: {supported}")
        self.field, self.value = field, value


def architecture(cfg: dict[str, Any]) -> str:
    if cfg.get("architectures"):
        return cfg["architectures"][0]
    kind = cfg.get("model_type") or cfg.get("architecture") or "?"
    return MODEL_TYPES.get(kind, kind)


def rope_types(cfg: dict[str, Any]) -> list[tuple[str, dict]]:
    """(field, parameters) of every RoPE setting in the config: transformers 4 (`rope_scaling`), 5
    (`rope_parameters`, nested per layer type for Gemma 3)."""
    out: list[tuple[str, dict]] = []
    if isinstance(cfg.get("rope_scaling"), dict):
        out.append(("rope_scaling", cfg["rope_scaling"]))
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        nested = [k for k in LAYER_TYPES if isinstance(rp.get(k), dict)]
        out += [(f"rope_parameters.{k}", rp[k]) for k in nested] or [("rope_parameters", rp)]
    return out


def check_config(cfg: dict[str, Any]) -> str:
    """The architecture if the engine computes this config exactly as transformers does; else UnsupportedModel."""
    arch = architecture(cfg)
    if arch not in ARCHITECTURES:
        why = f" ({WHY_NOT[arch]})" if arch in WHY_NOT else ""
        raise UnsupportedModel("architectures", arch, ", ".join(ARCHITECTURES) + why)
    for field, params in rope_types(cfg):
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in ROPE_TYPES:
            raise UnsupportedModel(f"{field}.rope_type", kind, ", ".join(ROPE_TYPES))
        partial = params.get("partial_rotary_factor", 1.0)
        if partial not in (None, 1, 1.0):
            raise UnsupportedModel(f"{field}.partial_rotary_factor", partial, "1.0 (rotary over the whole head)")
    if cfg.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise UnsupportedModel("partial_rotary_factor", cfg["partial_rotary_factor"], "1.0")
    act_field = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    act = cfg.get(act_field) or "silu"
    if act not in ACTIVATIONS:
        raise UnsupportedModel(act_field, act, ", ".join(ACTIVATIONS))
    for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if not isinstance(cfg.get(flag, False), bool):
            raise UnsupportedModel(flag, cfg[flag], "true or false")
    if arch not in ("LlamaForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
                    "Gemma3ForCausalLM") and cfg.get("attention_bias"):
        raise UnsupportedModel("attention_bias", True, f"false for {arch}")
    if arch != "LlamaForCausalLM" and cfg.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias", True, f"false for {arch} (true only for LlamaForCausalLM)")
    window = cfg.get("sliding_window")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise UnsupportedModel("sliding_window", window, "null or a positive number of tokens")
    bad_types = [t for t in cfg.get("layer_types") or [] if t not in LAYER_TYPES]
    if bad_types:
        raise UnsupportedModel("layer_types", bad_types[0], ", ".join(LAYER_TYPES))
    if cfg.get("layer_types") and len(cfg["layer_types"]) != cfg.get("num_hidden_layers"):
        raise UnsupportedModel("layer_types", f"{len(cfg['layer_types'])} entries", "one per hidden layer")
    if "sliding_attention" in (cfg.get("layer_types") or []) and not window:
        raise UnsupportedModel("sliding_window", window, "a window size when layer_types has sliding_attention")
    if cfg.get("use_mrope") or (cfg.get("rope_scaling") or {}).get("mrope_section"):
        raise UnsupportedModel("rope_scaling.mrope_section", True, "1-D RoPE only")
    return arch
