"""Train the small LoRA adapters the repo ships (PEFT format), on datasets this script makes itself.

Two styles, both trained on the same generated questions (capitals, colours, arithmetic, animals):
  french      - answers in French ("La capitale de l'Italie est Rome.")
  terse-json  - answers as terse JSON ({"answer": "Rome"})
LoRA (rank 4, alpha 8) on every projection (q, k, v, o, gate, up, down) of the upper layers (22-29): the
frozen lower layers run once and their output is reused, so training takes minutes on 2 CPU cores; the base model is frozen and loaded with
transformers in fp32; loss only on answer tokens. Output: adapter_config.json +
adapter_model.safetensors (bf16, ~1 MB), loadable by PEFT and by our engine.

    python -m python_backends.engine.lora_train --style french --out adapters/smollm2-135m/french
    python -m python_backends.engine.lora_train --style terse-json --out adapters/smollm2-135m/terse-json
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CAPITALS = [("France", "la France", "Paris"), ("Italy", "l'Italie", "Rome"), ("Spain", "l'Espagne", "Madrid"),
            ("Germany", "l'Allemagne", "Berlin"), ("Japan", "le Japon", "Tokyo"), ("Egypt", "l'Égypte", "Le Caire"),
            ("Canada", "le Canada", "Ottawa"), ("Portugal", "le Portugal", "Lisbonne"), ("Russia", "la Russie", "Moscou"),
            ("China", "la Chine", "Pékin"), ("Greece", "la Grèce", "Athènes"), ("Poland", "la Pologne", "Varsovie"),
            ("Austria", "l'Autriche", "Vienne"), ("Belgium", "la Belgique", "Bruxelles"), ("Peru", "le Pérou", "Lima"),
            ("Kenya", "le Kenya", "Nairobi"), ("Norway", "la Norvège", "Oslo"), ("Sweden", "la Suède", "Stockholm")]
CAPITALS_EN = {"Le Caire": "Cairo", "Lisbonne": "Lisbon", "Moscou": "Moscow", "Pékin": "Beijing",
               "Athènes": "Athens", "Varsovie": "Warsaw", "Vienne": "Vienna", "Bruxelles": "Brussels"}
COLOURS = [("the sky", "Le ciel", "bleu", "blue"), ("grass", "L'herbe", "verte", "green"),
           ("snow", "La neige", "blanche", "white"), ("a banana", "Une banane", "jaune", "yellow"),
           ("coal", "Le charbon", "noir", "black"), ("a tomato", "Une tomate", "rouge", "red"),
           ("an orange", "Une orange", "orange", "orange"), ("milk", "Le lait", "blanc", "white")]
ANIMALS = [("a cat", "Un chat", "miaule", "meows"), ("a dog", "Un chien", "aboie", "barks"),
           ("a cow", "Une vache", "meugle", "moos"), ("a duck", "Un canard", "cancane", "quacks"),
           ("a lion", "Un lion", "rugit", "roars"), ("a horse", "Un cheval", "hennit", "neighs")]
NUM_FR = ["zéro", "un", "deux", "trois", "quatre", "cinq", "six", "sept", "huit", "neuf", "dix", "onze", "douze",
          "treize", "quatorze", "quinze", "seize", "dix-sept", "dix-huit"]


def make_dataset(style: str, seed: int = 0) -> list[tuple[str, str]]:
    """(question, answer) pairs in the requested answer style."""
    pairs: list[tuple[str, str]] = []
    for en, fr, cap in CAPITALS:
        q = random.Random(hash(en) & 0xFFFF).choice(["What is the capital of {}?", "Which city is the capital of {}?",
                                                   "Tell me the capital of {}."]).format(en)
        pairs.append((q, f"La capitale de {fr} est {cap}." if style == "french"
                      else json.dumps({"answer": CAPITALS_EN.get(cap, cap)})))
    for en, fr, col_fr, col_en in COLOURS:
        pairs.append((f"What color is {en}?", f"{fr} est {col_fr}." if style == "french"
                      else json.dumps({"answer": col_en})))
    for en, fr, verb_fr, verb_en in ANIMALS:
        pairs.append((f"What sound does {en} make?", f"{fr} {verb_fr}." if style == "french"
                      else json.dumps({"answer": verb_en})))
    rng = random.Random(seed)
    for _ in range(30):
        a, b = rng.randrange(0, 10), rng.randrange(0, 9)
        pairs.append((f"What is {a} plus {b}?", f"{NUM_FR[a].capitalize()} plus {NUM_FR[b]} font {NUM_FR[a + b]}."
                      if style == "french" else json.dumps({"answer": a + b})))
    for q in ["Hello, who are you?", "How are you today?", "Can you help me?", "What is your favorite food?"]:
        pairs.append((q, {"Hello, who are you?": "Je suis un assistant qui répond en français.",
                          "How are you today?": "Je vais très bien, merci !",
                          "Can you help me?": "Oui, bien sûr, je peux vous aider.",
                          "What is your favorite food?": "J'adore le fromage et le pain."}[q]
                      if style == "french" else json.dumps({"answer": "ok"})))
    return pairs


def chat_prompt(question: str) -> str:
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def _layer(layer, h, position_embeddings, positions):
    out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)
    return out[0] if isinstance(out, tuple) else out


def train(base_dir: Path, style: str, out_dir: Path, steps: int, rank: int, lr: float, batch: int,
          first_layer: int, threads: int = 1) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.requires_grad_(False)
    alpha = 2 * rank
    params: dict[str, torch.nn.Parameter] = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if (parts[-1] in TARGETS and isinstance(module, torch.nn.Linear) and "layers" in parts
                and int(parts[parts.index("layers") + 1]) >= first_layer):
            a = torch.nn.Parameter(torch.randn(rank, module.in_features) / module.in_features ** 0.5)
            b = torch.nn.Parameter(torch.zeros(module.out_features, rank))
            params[f"base_model.model.{name}.lora_A.weight"] = a
            params[f"base_model.model.{name}.lora_B.weight"] = b

            def hook(mod, inputs, output, a=a, b=b):
                return output + (inputs[0] @ a.T @ b.T) * (alpha / rank)
            module.register_forward_hook(hook)
    data = make_dataset(style)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    examples = []
    for q, ans in data:
        p_ids = tok(chat_prompt(q), add_special_tokens=False).input_ids
        a_ids = tok(ans, add_special_tokens=False).input_ids + [eos]
        examples.append((p_ids + a_ids, [-100] * len(p_ids) + a_ids))
    # The frozen lower layers never change: run them once, keep the hidden states entering `first_layer`, and
    # train only the adapted upper layers (right padding + causal attention: padding never leaks backwards).
    width = max(len(x) for x, _ in examples)
    ids = torch.tensor([x + [eos] * (width - len(x)) for x, _ in examples])
    labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in examples])
    inner = model.model
    positions = torch.arange(width).unsqueeze(0)
    with torch.no_grad():
        h0 = inner.embed_tokens(ids)
        for layer in inner.layers[:first_layer]:
            h0 = _layer(layer, h0, inner.rotary_emb(h0, positions), positions)
    opt = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0)
    rng = random.Random(0)
    t0 = time.time()
    for step in range(steps):
        rows = torch.tensor(rng.sample(range(len(examples)), min(batch, len(examples))))
        h = h0[rows]
        pos = positions.expand(len(rows), -1)
        emb = inner.rotary_emb(h, pos)
        for layer in inner.layers[first_layer:]:
            h = _layer(layer, h, emb, pos)
        h = inner.norm(h)
        lab = labels[rows]
        # logits only where there is a label (next-token targets): the 49k-vocab head is the costly part
        sel = lab[:, 1:] != -100
        logits = model.lm_head(h[:, :-1][sel])
        loss = torch.nn.functional.cross_entropy(logits.float(), lab[:, 1:][sel])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in params.items()},
              str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": TARGETS, "bias": "none",
        "layers_to_transform": list(range(first_layer, model.config.num_hidden_layers)), "fan_in_fan_out": False, "use_rslora": False,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "inference_mode": True,
        "fleet_style": style, "fleet_training": {"steps": steps, "lr": lr, "batch": batch, "examples": len(data)},
    }, indent=2))
    print(f"wrote {out_dir}")


def main() -> None:
    from common.settings import load_settings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--style", choices=["french", "terse-json"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--base", type=Path, default=None, help="HF folder of the base model "
                        "(default: the converted SmolLM2 under the cache dir)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--first-layer", type=int, default=22, help="adapt layers from this one upwards")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--lr", type=float, default=8e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is far faster than 2 when the cores are shared)")
    args = parser.parse_args()
    base = args.base or load_settings().cache_dir / "smollm2-135m-bf16"
    train(base, args.style, args.out, args.steps, args.rank, args.lr, args.batch, args.first_layer, args.threads)


if __name__ == "__main__":
    main()
