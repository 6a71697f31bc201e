"""The GPU Triton repository as build_engines renders it, with the stand-in (tests/gpu/standin/model.py) as the
Python-backend `tensorrt_llm` model under the real rendered config (only `backend:` changes)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from build_engines import trtllm, xgrammar_info
from build_engines.plan import BuildOptions, inspect_checkpoint, resolve

STANDIN = Path(__file__).parent / "standin" / "model.py"
TOKENS_PER_BLOCK = 16  # small blocks so that test prompts of ~100 tokens reuse whole blocks


def render_standin_repository(checkpoint: Path, out_dir: Path, adapters_dir: Path, model: str = "smollm2-gpu",
                              version: str = "1", lora_cache_tasks: int = 4) -> Path:
    """Render the real GPU templates for `checkpoint` (an HF folder) into out_dir, stand-in engine inside."""
    opts = BuildOptions(model=model, version=version, checkpoint=str(checkpoint), target="trtllm", dtype="bf16",
                        max_batch_size=8, max_num_tokens=2048)
    plan = resolve(opts, inspect_checkpoint(str(checkpoint)))
    values = trtllm.trtllm_values(plan, checkpoint, checkpoint, adapters_dir)
    values["tokens_per_block"] = str(TOKENS_PER_BLOCK)
    values["guided_decoding"] = "on"   # the stand-in applies the guide inputs, as tensorrtllm_backend >= 0.19 does
    # guided decoding's tokenizer file, as the trtllm build writes it (beside the served tokenizer there)
    info = out_dir / xgrammar_info.FILENAME
    values["xgrammar_tokenizer_info_path"] = str(info)
    repo = trtllm.render(values, out_dir)  # (re)creates out_dir
    xgrammar_info.write(checkpoint, info.parent)
    config = repo / "tensorrt_llm" / "config.pbtxt"
    text, n = re.subn(r'^backend: "tensorrtllm"$', 'backend: "python"', config.read_text(), flags=re.M)
    assert n == 1, "the rendered tensorrt_llm config no longer names the tensorrtllm backend"
    for key, value in (("tokens_per_block_standin", TOKENS_PER_BLOCK), ("lora_cache_tasks_standin", lora_cache_tasks)):
        text += f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    config.write_text(text)
    shutil.copy(STANDIN, repo / "tensorrt_llm" / "1" / "model.py")
    return repo
