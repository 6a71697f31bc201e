"""Measure a decode step-time curve and a prefill rate for `fleet simulate --calibrate` on a GPU.

A minimal plain-PyTorch Llama step (random bf16 weights, contiguous KV cache, SDPA with GQA): the decode
step replayed from a CUDA graph (what an optimised engine's launch overhead approaches) at several batch
sizes with each sequence holding `--ctx` tokens of KV, and eager prefill of `--prompt`-token prompts. It is
an anchor for the simulator's capacity model, not an engine: no paged KV, no fused kernels, no fp8.

    python bench/autoscale/gpu_decode_curve.py --out bench/results/gpu-decode-curve-8b-h200.jsonl
    python bench/autoscale/gpu_decode_curve.py --device cpu --shape tiny --batches 1 4   # seconds, for a smoke run

Output: JSON lines `{model, device, gpu, batch, ctx, prompt, decode_step_ms, decode_tok_s, prefill_tok_s}`,
the format `autoscale/simulator/calibrate.py` reads.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # hidden, layers, heads, kv heads, head dim, ffn, vocab (public configs)
    "llama-3.1-8b": (4096, 32, 32, 8, 128, 14336, 128256),
    "tiny": (64, 2, 4, 2, 16, 128, 1000),
}


class Llama:
    """Random-weight Llama decoder: `forward(tokens [B, T], caches, start)` writes K/V at start..start+T."""

    def __init__(self, shape: str, device: torch.device, dtype: torch.dtype) -> None:
        self.h, self.L, self.nh, self.kvh, self.d, self.ff, self.V = SHAPES[shape]
        self.dev, self.dt = device, dtype

        def rnd(*s: int) -> torch.Tensor:
            return torch.randn(*s, device=device, dtype=dtype) * 0.02

        self.emb = rnd(self.V, self.h)
        self.layers = [dict(qkv=rnd((self.nh + 2 * self.kvh) * self.d, self.h), o=rnd(self.h, self.nh * self.d),
                            gu=rnd(2 * self.ff, self.h), down=rnd(self.h, self.ff)) for _ in range(self.L)]
        self.norm = torch.ones(self.h, device=device, dtype=dtype)
        self.inv = 1.0 / (10000 ** (torch.arange(0, self.d, 2, device=device, dtype=torch.float32) / self.d))

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [B, heads, T, d], pos [T]
        f = pos[:, None].float() * self.inv[None]
        c, s = f.cos()[None, None].to(self.dt), f.sin()[None, None].to(self.dt)
        x1, x2 = x[..., : self.d // 2], x[..., self.d // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def forward(self, tokens: torch.Tensor, caches: list, start: int) -> torch.Tensor:
        B, T = tokens.shape
        pos = torch.arange(start, start + T, device=self.dev)
        x = self.emb[tokens]
        for w, (kc, vc) in zip(self.layers, caches):
            y = F.rms_norm(x, (self.h,), self.norm)
            q, k, v = (y @ w["qkv"].T).split([self.nh * self.d, self.kvh * self.d, self.kvh * self.d], -1)
            q = self.rope(q.view(B, T, self.nh, self.d).transpose(1, 2), pos)
            k = self.rope(k.view(B, T, self.kvh, self.d).transpose(1, 2), pos)
            kc[:, :, start:start + T] = k
            vc[:, :, start:start + T] = v.view(B, T, self.kvh, self.d).transpose(1, 2)
            att = F.scaled_dot_product_attention(q, kc[:, :, :start + T], vc[:, :, :start + T], is_causal=T > 1,
                                                 enable_gqa=True)
            x = x + att.transpose(1, 2).reshape(B, T, self.nh * self.d) @ w["o"].T
            g, u = (F.rms_norm(x, (self.h,), self.norm) @ w["gu"].T).chunk(2, -1)
            x = x + (F.silu(g) * u) @ w["down"].T
        return (F.rms_norm(x[:, -1], (self.h,), self.norm) @ self.emb.T).argmax(-1)

    def caches(self, batch: int, tokens: int) -> list:
        return [(torch.zeros(batch, self.kvh, tokens, self.d, device=self.dev, dtype=self.dt),
                 torch.zeros(batch, self.kvh, tokens, self.d, device=self.dev, dtype=self.dt)) for _ in range(self.L)]


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def decode_step_s(model: Llama, batch: int, ctx: int, reps: int) -> float:
    """Seconds per decode step at `batch` sequences of `ctx` tokens (CUDA graph on a GPU, eager on CPU)."""
    caches = model.caches(batch, ctx + 1)
    tok = torch.zeros(batch, 1, dtype=torch.long, device=model.dev)
    run = lambda: model.forward(tok, caches, ctx)  # noqa: E731
    if model.dev.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    run()
    sync(model.dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    sync(model.dev)
    return (time.perf_counter() - t0) / reps


def prefill_tok_s(model: Llama, prompt: int, batch: int, reps: int) -> float:
    caches = model.caches(batch, prompt)
    tokens = torch.zeros(batch, prompt, dtype=torch.long, device=model.dev)
    model.forward(tokens, caches, 0)
    sync(model.dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        model.forward(tokens, caches, 0)
    sync(model.dev)
    return batch * prompt * reps / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32, 64, 96, 128])
    parser.add_argument("--ctx", type=int, default=2150, help="KV tokens per decoding sequence (prompt + half the output)")
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="JSON lines (default: stdout)")
    args = parser.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.inference_mode():
        model = Llama(args.shape, dev, dtype)
        prefill = prefill_tok_s(model, args.prompt, args.prefill_batch, max(2, args.reps // 5))
        rows = []
        for batch in args.batches:
            step = decode_step_s(model, batch, args.ctx, args.reps)
            rows.append({"model": f"{args.shape}-shape", "device": dev.type,
                         "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "",
                         "batch": batch, "ctx": args.ctx, "prompt": args.prompt, "decode_step_ms": round(step * 1e3, 3),
                         "decode_tok_s": round(batch / step, 1), "prefill_tok_s": round(prefill)})
            print(json.dumps(rows[-1]), flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
