"""The quality gate's reference: the checkpoint's own transformers run in fp32, on the CPU.

For each evaluation prompt: the prompt's ids (the checkpoint's tokenizer, its own special-token settings), the
greedy continuation (`min_new_tokens` keeps EOS out so every prompt scores the same number of positions), then
one teacher-forced forward over prompt + continuation giving the reference's top-1 and the log-probability of
the continuation token at each position. The result is cached per (checkpoint sha256, eval-set sha256, prompts,
tokens, transformers version): a checkpoint's reference is computed once per machine, and a rebuild or a
damaged conversion of the same checkpoint is compared with the same numbers.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from rich.progress import Progress

from build_engines import stage
from build_engines.quality_gate import GATE_VERSION, GateOptions, Reference, eval_set_sha256, load_eval_set

BATCH = 16


def cache_path(cache_dir: Path, checkpoint_sha256: str, opts: GateOptions) -> Path:
    import transformers
    key = json.dumps([checkpoint_sha256, eval_set_sha256(), opts.prompts, opts.gen_tokens, GATE_VERSION,
                      transformers.__version__])
    return cache_dir / "quality-gate" / f"ref-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def load_reference_model(checkpoint: Path, device_map: str | None = None):
    """(model, tokenizer) in fp32 from an HF folder or a .gguf file (dequantised on load); device_map "auto"
    spreads a large checkpoint over the GPU node's devices (the TensorRT-LLM gate)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if checkpoint.is_file() and checkpoint.suffix == ".gguf":
        name = checkpoint.name
        kwargs = {"gguf_file": name, "quantization_config": GgufConfig(gguf_file=name, dequantize=True)}
        tok = AutoTokenizer.from_pretrained(checkpoint.parent, gguf_file=name)
        source = checkpoint.parent
    else:
        kwargs, source = {}, checkpoint
        tok = AutoTokenizer.from_pretrained(checkpoint)
    if device_map:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs).eval()
    return model, tok


@torch.inference_mode()
def compute_reference(checkpoint: Path, opts: GateOptions, device_map: str | None = None) -> Reference:
    model, tok = load_reference_model(checkpoint, device_map)
    dev = model.device
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # shared build nodes: see gate_engine.GATE_THREADS
    try:
        return _run_reference(model, tok, checkpoint, opts, dev)
    finally:
        torch.set_num_threads(threads)


def _run_reference(model, tok, checkpoint: Path, opts: GateOptions, dev) -> Reference:
    from build_engines.quality_gate import score_positions

    texts = load_eval_set()[:opts.prompts]
    prompts = [tok(t)["input_ids"] for t in texts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    conts: list[list[int]] = []
    top1: list[list[int]] = []
    logprobs: list[list[float]] = []
    with Progress(transient=True, console=stage.console) as bar:
        task = bar.add_task(f"quality gate: reference (transformers fp32, {len(prompts)} prompts)",
                            total=len(prompts))
        for i in range(0, len(prompts), BATCH):
            group = prompts[i:i + BATCH]
            width = max(map(len, group))
            # left padding for generation: every row's last prompt token is the last column
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=opts.gen_tokens,
                                 min_new_tokens=opts.gen_tokens, do_sample=False, pad_token_id=pad)
            gen = out[:, width:].cpu().tolist()
            # teacher-forced scoring in one forward: right padding (causal attention: a row's positions never
            # see the padding after them)
            rows = [p + c[:-1] for p, c in zip(group, gen)]
            long = max(map(len, rows))
            ids = torch.tensor([r + [pad] * (long - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (long - len(r)) for r in rows])
            logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits
            for j, (p, c) in enumerate(zip(group, gen)):
                t1, lp = score_positions(logits[j, len(p) - 1:len(p) - 1 + len(c)], c)
                conts.append(c)
                top1.append(t1)
                logprobs.append(lp)
            bar.advance(task, len(group))
    import transformers
    meta = {"kind": "transformers fp32 (cpu)", "transformers": transformers.__version__,
            "checkpoint": str(checkpoint)}
    return Reference(prompts, conts, top1, logprobs, meta)


def reference(checkpoint: Path, checkpoint_sha256: str, opts: GateOptions, cache_dir: Path) -> Reference:
    """The cached reference of `checkpoint`, computed now when missing."""
    path = cache_path(cache_dir, checkpoint_sha256, opts)
    try:
        data = json.loads(path.read_text())
        ref = Reference(**data)
        ref.meta = {**ref.meta, "cached": True}
        return ref
    except (OSError, json.JSONDecodeError, TypeError):
        pass
    ref = compute_reference(checkpoint, opts)
    ref.meta["checkpoint_sha256"] = checkpoint_sha256
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(ref.__dict__))
    tmp.rename(path)
    ref.meta = {**ref.meta, "cached": False}
    return ref
