"""The tokenizer file TensorRT-LLM's C++ guided decoding reads (`xgrammar_tokenizer_info_path` of the
tensorrt_llm model): JSON with `encoded_vocab` (every token string, by id), `tokenizer_str` (the HF
tokenizer.json text) and `stop_token_ids` - the keys tensorrtllm_backend's
ModelInstanceState::getGuidedDecodingConfigFromParams parses (v0.19+), the content TensorRT-LLM's
examples/generate_xgrammar_tokenizer_info.py writes. Written here from the tokenizer files alone (no
TensorRT-LLM needed), with every EOS id of the model as a stop id (common/eos.py), so a constrained output
ends on whichever the model emits.

    python -m build_engines.xgrammar_info --model_dir <hf folder> --output_dir <folder>
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.eos import eos_token_ids
from common.text import load_tokenizer

FILENAME = "xgrammar_tokenizer_info.json"


def tokenizer_info(model_dir: str | Path) -> dict:
    folder = Path(model_dir)
    tok = load_tokenizer(folder)
    vocab = tok.get_vocab(with_added_tokens=True)
    encoded = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        encoded[i] = token
    return {"encoded_vocab": encoded, "tokenizer_str": (folder / "tokenizer.json").read_text(),
            "stop_token_ids": eos_token_ids(folder, tok)}


def write(model_dir: str | Path, output_dir: str | Path) -> Path:
    out = Path(output_dir) / FILENAME
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(tokenizer_info(model_dir)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m build_engines.xgrammar_info", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_dir", required=True, help="HF model folder (tokenizer.json)")
    ap.add_argument("--output_dir", required=True)
    args = ap.parse_args(argv)
    print(write(args.model_dir, args.output_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
