"""Regenerates the two text sets build-engines ships (docs/build_engines.md), written for this project from the
templates and subjects below, so neither has a third-party licence (they are part of this repository):
- build_engines/eval/prompts.jsonl: the quality gate's fixed evaluation set, short prompts;
- build_engines/calib/train.jsonl: the default fp8 calibration set of the TensorRT-LLM build (ModelOpt reads a
  local folder's `train` split, `text` column), paragraphs built from other sentences than the prompts, so the
  gate never scores what the quantiser calibrated on.
Deterministic: running it again rewrites the same files; every gate report records the prompts' sha256.

    .venv/bin/python -m build_engines.eval.generate_prompts
"""
from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("prompts.jsonl")
CALIB_OUT = Path(__file__).parent.parent / "calib" / "train.jsonl"
CALIB_SAMPLES = 512

SUBJECTS = ["the ocean", "a mountain village", "the moon", "a small bakery", "the history of paper",
            "a thunderstorm", "the human heart", "a city library", "winter in the north", "honey bees",
            "the first computers", "a train journey", "desert plants", "the river Nile", "volcanoes",
            "a chess game", "the solar system", "ancient Rome", "a garden in spring", "electric cars",
            "the printing press", "coral reefs", "a music festival", "the Arctic fox", "rain forests",
            "a lighthouse keeper", "the speed of light", "medieval castles", "a busy airport", "green tea"]
TEMPLATES = ["Write one sentence about {s}.", "Here is a short story about {s}. Once upon a time,",
             "The most interesting fact about {s} is that", "Explain {s} to a child:",
             "Three words that describe {s} are", "A news headline about {s}:",
             "Q: What do you know about {s}?\nA:", "In the year 1900, {s}",
             "My favourite thing about {s} is", "A short poem about {s}:\n"]
CODE = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "def is_prime(n: int) -> bool:\n", "# Python: read a file and count its lines\n",
        "SELECT name, COUNT(*) FROM orders", "for (int i = 0; i < n; i++) {\n",
        "def reverse_string(s):\n", "import json\n\ndef load_config(path):\n",
        "class Stack:\n    def __init__(self):\n", "<html>\n  <head>\n    <title>", "def mean(values):\n"]
FACTS = ["The capital of France is", "Water boils at a temperature of", "The largest planet in our solar system is",
         "The chemical symbol for gold is", "There are seven days in a week: Monday,", "One, two, three, four,",
         "The opposite of hot is", "A triangle has three sides and a square has", "The first month of the year is",
         "Photosynthesis is the process by which", "The Pacific Ocean is", "The author of Romeo and Juliet is",
         "January, February, March,", "2 + 2 = 4, 3 + 3 =", "The colours of the rainbow are",
         "Paris, London, Berlin and", "An apple a day", "The sun rises in the", "Dogs are loyal animals that",
         "The boiling point of water in Fahrenheit is"]


def prompts() -> list[dict[str, str]]:
    rng = random.Random(33)
    rows = [{"kind": "topic", "text": t.format(s=s)} for s in SUBJECTS for t in TEMPLATES]
    rng.shuffle(rows)
    rows = rows[:220] + [{"kind": "code", "text": c} for c in CODE] + [{"kind": "fact", "text": f} for f in FACTS]
    rng.shuffle(rows)  # any prefix of the file (--gate-prompts N) mixes the kinds
    return [{"id": i, **r} for i, r in enumerate(rows)]


SENTENCES = ["People have studied {s} for a very long time, and new questions keep appearing.",
             "Many visitors say that {s} changed the way they think about everyday life.",
             "A report published last spring described {s} in careful detail.",
             "Teachers often use {s} as an example when they explain difficult ideas.",
             "The history of {s} is full of surprising turns and forgotten names.",
             "Engineers and scientists still disagree about the best way to measure {s}.",
             "In small towns, conversations about {s} can last for hours.",
             "Photographs of {s} rarely capture how it feels to be there.",
             "Some of the oldest books in the library mention {s} only in passing.",
             "Children who learn about {s} early tend to remember it for years."]


def calibration_texts() -> list[dict[str, str]]:
    rng = random.Random(1733)
    rows = []
    for _ in range(CALIB_SAMPLES):
        subject = rng.choice(SUBJECTS)
        picked = rng.sample(SENTENCES, rng.randint(4, 7))
        rows.append({"text": " ".join(t.format(s=subject) for t in picked)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {path} ({len(rows)} rows)")


def main() -> None:
    write_jsonl(OUT, prompts())
    write_jsonl(CALIB_OUT, calibration_texts())


if __name__ == "__main__":
    main()
