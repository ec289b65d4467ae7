"""Rebuild the embedded default task from the committed corpus (fixed seeds, 2 CPU cores).

Steps, each written into ``textgym/assets``:

1. corpus: read ``data/reviews.jsonl`` (made by ``generate_corpus.py``), drop junk and
   near-duplicates, label each review by VADER (the gold scorer); the LM's training split
   repeats negative reviews so that they are at least a third of it;
2. tokenizer: byte-level BPE trained with ``tokenizers`` (``<pad>``=0, ``<bos>``=1, ``<eos>``=2);
3. prompts: sentiment-neutral review openings, train and eval splits (from disjoint reviews);
4. ``lm/``: the reference (SFT) policy, a small ``LlamaForCausalLM`` trained on the corpus;
5. ``rm/``: the reward model, a ``LlamaForSequenceClassification`` initialised from the SFT
   body and trained with the Bradley–Terry loss on pairs judged by VADER — pairs drawn from
   corpus reviews and from SFT samples — then calibrated: its score mean/std under π_ref on the
   train prompts is stored beside it for normalisation.

Usage::

    python -m textgym.assets.build            # full rebuild (19 min on 2 cores)
    python -m textgym.assets.build --quick    # a tiny, fast build for smoke tests

``data/build_report.json`` records what the build measured (perplexity, RM accuracy,
Spearman correlation with the gold score, normalisation stats).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from textgym.files import save_folder_atomically
from textgym.rewards.base import save_norm
from textgym.rewards.builtin import VaderScorer
from textgym.rewards.calibrate import sample_episodes
from textgym.rewards.training import PreferencePair, train_reward_model

HERE = Path(__file__).parent
DATA = HERE / "data"


@dataclass
class BuildConfig:
    """Sizes and budgets of the embedded models (defaults: the shipped build)."""

    seed: int = 0
    vocab_size: int = 2048
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 704
    max_positions: int = 128
    lm_epochs: int = 3
    lm_lr: float = 2e-3
    lm_batch_size: int = 32
    lm_eval_every: int = 100
    rm_epochs: int = 2
    rm_lr: float = 3e-4
    rm_batch_size: int = 32
    rm_pairs_per_item: float = 1.2  # random pairs per (opening, response) item: pairs scale with the corpus
    rm_sample_prompts: int = 800
    rm_samples_per_prompt: int = 4
    rm_gold_margin: float = 0.2
    n_train_prompts: int = 1000
    n_eval_prompts: int = 200
    calib_prompts: int = 512
    max_new_tokens: int = 32

    @classmethod
    def quick(cls) -> BuildConfig:
        return cls(
            vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
            lm_epochs=1, rm_epochs=1, rm_pairs_per_item=0.35, rm_sample_prompts=50,
            n_train_prompts=50, n_eval_prompts=20, calib_prompts=32,
        )  # fmt: skip


# ---------------------------------------------------------------- corpus
def load_corpus(path: Path, seed: int) -> list[dict]:
    """Drop junk and near-duplicates, VADER-label and shuffle the raw generations."""
    vader = VaderScorer()
    seen, rows = set(), []
    for line in path.read_text().splitlines():
        text = json.loads(line)["text"]
        if not text:
            continue
        key = re.sub(r"[^a-z ]", "", text.lower())[:60]
        if key in seen:
            continue
        seen.add(key)
        rows.append({"text": text})
    gold = vader.score_texts([r["text"] for r in rows])
    for r, g in zip(rows, gold):
        r["gold"] = float(g)
    random.Random(seed).shuffle(rows)
    return rows


def upsample_negatives(rows: list[dict]) -> list[dict]:
    """Repeat negative reviews so they make up at least a third of the LM's training text.

    SmolLM2 writes mostly positive reviews; dropping positives would cost fluency (the corpus,
    not compute, limits a tiny LM), so the minority is repeated instead.
    """
    neg = [r for r in rows if r["gold"] <= -0.05]
    if not neg:
        return rows
    copies = max(0, math.ceil((len(rows) - len(neg)) / (2 * len(neg))) - 1)
    return rows + neg * copies


def split(rows: list[dict], frac: float = 0.1) -> tuple[list[dict], list[dict]]:
    n = max(1, int(len(rows) * frac))
    return rows[n:], rows[:n]


# ---------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    tok.model_max_length = 128
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    tok.save_pretrained(out)
    return tok


# ---------------------------------------------------------------- prompts
def make_prompts(rows: list[dict], n: int, seed: int) -> list[str]:
    """Sentiment-neutral openings of 2–4 words ("The movie was", "I just saw a")."""
    vader, rng = VaderScorer(), random.Random(seed)
    counts: dict[str, int] = {}
    for r in rows:
        words = r["text"].split()
        k = rng.choice([2, 3, 3, 4])
        opening = " ".join(words[:k])
        if len(words) > k + 3 and opening[-1].isalnum() and vader.score_texts([opening])[0] == 0.0:
            counts[opening] = counts.get(opening, 0) + 1
    ranked = sorted(counts, key=lambda p: (-counts[p], p))
    return ranked[:n]


MAX_PROMPT_TOKENS = 10


def plain_prompt(prompt: str, tok) -> bool:
    """Words, apostrophes and commas only, and at most MAX_PROMPT_TOKENS tokens (BOS included)."""
    return (
        bool(re.fullmatch(r"[A-Za-z',]+( [A-Za-z',]+)*", prompt)) and len(tok(prompt)["input_ids"]) <= MAX_PROMPT_TOKENS
    )


# ---------------------------------------------------------------- SFT policy
def lm_config(cfg: BuildConfig, tok):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )


def _lm_batches(seqs: list[list[int]], batch_size: int, rng: random.Random):
    order = list(range(len(seqs)))
    rng.shuffle(order)
    for start in range(0, len(order), batch_size):
        chunk = [seqs[i] for i in order[start : start + batch_size]]
        width = max(len(s) for s in chunk)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in chunk])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
        yield ids, mask


@torch.no_grad()
def lm_perplexity(model, seqs: list[list[int]], batch_size: int = 64) -> float:
    model.eval()
    nll, count = 0.0, 0
    for ids, mask in _lm_batches(seqs, batch_size, random.Random(0)):
        labels = ids.masked_fill(mask == 0, -100)
        n = int((labels[:, 1:] != -100).sum())
        nll += model(input_ids=ids, attention_mask=mask, labels=labels).loss.item() * n
        count += n
    return math.exp(nll / count)


def train_lm(cfg: BuildConfig, tok, train: list[str], val: list[str], out: Path) -> dict:
    """Next-token training on ``<bos> review <eos>``; keeps the step with the best held-out loss."""
    from tqdm.auto import tqdm
    from transformers import LlamaForCausalLM, get_cosine_schedule_with_warmup

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    enc = lambda texts: [ids + [tok.eos_token_id] for ids in tok(texts)["input_ids"]]  # noqa: E731
    train_ids, val_ids = enc(train), enc(val)
    model = LlamaForCausalLM(lm_config(cfg, tok))
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lm_lr, weight_decay=0.1, betas=(0.9, 0.95))
    steps = cfg.lm_epochs * math.ceil(len(train_ids) / cfg.lm_batch_size)
    warm = min(100, steps // 10 + 1)
    sched = get_cosine_schedule_with_warmup(optim, num_warmup_steps=warm, num_training_steps=steps)
    best, step = (math.inf, None), 0
    bar = tqdm(total=steps, desc="lm")
    for _ in range(cfg.lm_epochs):
        for ids, mask in _lm_batches(train_ids, cfg.lm_batch_size, rng):
            model.train()
            loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            step += 1
            bar.update()
            if step % cfg.lm_eval_every == 0 or step == steps:
                ppl = lm_perplexity(model, val_ids)
                bar.set_postfix(loss=f"{loss.item():.3f}", val_ppl=f"{ppl:.1f}")
                if ppl < best[0]:
                    best = (ppl, {k: v.clone() for k, v in model.state_dict().items()})
    bar.close()
    model.load_state_dict(best[1])
    model.to(torch.float16)
    model.generation_config.pad_token_id = tok.pad_token_id
    save_folder_atomically(out, lambda tmp: (model.save_pretrained(tmp), tok.save_pretrained(tmp)))
    n_params = sum(p.numel() for p in model.parameters())
    return {"val_perplexity": best[0], "parameters": n_params, "steps": step}


@torch.no_grad()
def sample(model, tok, prompts: list[str], n: int, max_new_tokens: int, seed: int, batch_size: int = 128) -> list:
    """(prompt, response) pairs sampled from ``model`` at temperature 1 with HF generate."""
    torch.manual_seed(seed)
    tok.padding_side = "left"
    out = []
    todo = [p for p in prompts for _ in range(n)]
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        enc = tok(chunk, return_tensors="pt", padding=True)
        gen = model.generate(
            **enc, do_sample=True, max_new_tokens=max_new_tokens, top_k=0, top_p=1.0,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        out.extend(zip(chunk, texts))
    return out


def real_word_rate(samples: list[str], corpus: list[str]) -> float:
    """Share of the words in ``samples`` that occur in ``corpus``: how often π_ref invents words."""
    known = {w for text in corpus for w in re.findall(r"[a-z]+", text.lower())}
    words = [w for text in samples for w in re.findall(r"[a-z]+", text.lower())]
    return sum(w in known for w in words) / max(1, len(words))


# ---------------------------------------------------------------- reward model
def make_pairs(
    items: list[tuple[str, str, float]], n_random: int, margin: float, rng: random.Random, per_prompt: int = 6
) -> list:
    """Pairs judged by the gold score: same-prompt pairs first, then random pairs; near-ties dropped."""
    by_prompt: dict[str, list] = {}
    for it in items:
        by_prompt.setdefault(it[0], []).append(it)
    pairs = []
    for group in by_prompt.values():
        # at most `per_prompt` pairs from one prompt: common openings would otherwise give O(n^2) pairs
        n_pairs = min(per_prompt, len(group) * (len(group) - 1) // 2)
        pairs.extend(tuple(rng.sample(group, 2)) for _ in range(n_pairs))
    for _ in range(n_random):
        pairs.append(tuple(rng.sample(items, 2)))
    out = []
    for a, b in pairs:
        if abs(a[2] - b[2]) < margin:
            continue  # a labeller with no clear preference skips the pair
        hi, lo = (a, b) if a[2] > b[2] else (b, a)
        # Different prompts: the pair compares whole texts, so the prompt lives in each side.
        if hi[0] == lo[0]:
            out.append(PreferencePair(hi[0], hi[1], lo[1]))
        else:
            out.append(PreferencePair("", hi[0] + hi[1], lo[0] + lo[1]))
    rng.shuffle(out)
    return out


def corpus_items(rows: list[dict], rng: random.Random) -> list[tuple[str, str, float]]:
    """Split each review into (opening, continuation, VADER of continuation).

    Only sentiment-neutral openings are kept, like the env's prompts: the gold scorer judges the
    response alone, so a sentiment-laden opening would make the label disagree with the text.
    """
    vader, items = VaderScorer(), []
    for r in rows:
        words = r["text"].split()
        k = rng.choice([2, 3, 4])
        prompt, response = " ".join(words[:k]), " " + " ".join(words[k:])
        if len(words) <= k or vader.score_texts([prompt])[0] != 0.0:
            continue
        items.append((prompt, response, float(vader.score_texts([response])[0])))
    return items


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def corpus_stats(rows: list[dict]) -> dict:
    """The report's summary of the corpus: the sentiment balance and length the LM and the RM learn from."""
    gold = np.array([r["gold"] for r in rows])
    return {
        "reviews": len(rows), "positive": int((gold >= 0.05).sum()), "negative": int((gold <= -0.05).sum()),
        "mean_words": float(np.mean([len(r["text"].split()) for r in rows])),
    }  # fmt: skip


def write_prompts(cfg: BuildConfig, train_rows: list[dict], val_rows: list[dict], tok, data_out: Path) -> list[str]:
    """Write the env's ``prompts_train.txt`` and ``prompts_eval.txt``; return the unfiltered train prompts.

    Train prompts come from train reviews, eval prompts from held-out reviews only. The env's prompt files keep
    plain openings of at most MAX_PROMPT_TOKENS tokens (a few generations open with dates or titles, which would
    widen every observation); the RM's SFT samples are drawn from the unfiltered list.
    """
    train_prompts = make_prompts(train_rows, cfg.n_train_prompts, cfg.seed)
    eval_prompts = [p for p in make_prompts(val_rows, 10 * cfg.n_eval_prompts, cfg.seed + 1)][: cfg.n_eval_prompts]
    for name, prompts in (("train", train_prompts), ("eval", eval_prompts)):
        kept = [p for p in prompts if plain_prompt(p, tok)]
        (data_out / f"prompts_{name}.txt").write_text("\n".join(kept) + "\n")
    return train_prompts


def sft_items(cfg: BuildConfig, lm, tok, prompts: list[str], rng: random.Random) -> list[tuple[str, str, float]]:
    """(prompt, SFT sample, VADER of the sample): the RM must also rank what π_ref writes, not only the corpus."""
    sft = sample(lm, tok, rng.sample(prompts, min(cfg.rm_sample_prompts, len(prompts))),
                 cfg.rm_samples_per_prompt, cfg.max_new_tokens, cfg.seed)  # fmt: skip
    return [(p, r, float(g)) for (p, r), g in zip(sft, VaderScorer().score_texts([r for _, r in sft]))]


def rm_pairs(
    cfg: BuildConfig,
    train_rows: list[dict],
    val_rows: list[dict],
    sft: list[tuple[str, str, float]],
    rng: random.Random,
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """Train and held-out pairs judged by the gold scorer, from corpus continuations and SFT samples.

    The held-out pairs come from held-out reviews and a tenth of the SFT samples, so the RM's
    held-out accuracy is measured on texts it did not train on.
    """
    n_sft_val = len(sft) // 10
    train_items = corpus_items(train_rows, rng) + sft[n_sft_val:]
    val_items = corpus_items(val_rows, rng) + sft[:n_sft_val]
    n_random = int(cfg.rm_pairs_per_item * len(train_items))
    train_pairs = make_pairs(train_items, n_random, cfg.rm_gold_margin, rng)
    val_pairs = make_pairs(val_items, n_random // 10, cfg.rm_gold_margin, rng)[:1000]
    return train_pairs, val_pairs


def write_pairs(data_out: Path, train_pairs: list[PreferencePair], val_pairs: list[PreferencePair]) -> None:
    """The exact pairs, so ``textgym rm-train --pairs ... --val-pairs ...`` rebuilds the same RM."""
    for name, pairs in (("train", train_pairs), ("val", val_pairs)):
        with (data_out / f"rm_pairs_{name}.jsonl").open("w") as f:
            for p in pairs:
                f.write(json.dumps({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}) + "\n")


def calibrate_rm(cfg: BuildConfig, lm_dir: Path, rm_dir: Path, prompts: Path) -> tuple[dict, list[dict]]:
    """Store the RM's score mean/std under π_ref beside it; return them with the RM's agreement with the gold
    scorer, and a few samples for the report.

    Measured through the env on the train prompts, as ``textgym rm-calibrate`` does, so the env normalises
    with the statistics of the episodes it will run.
    """
    rows = sample_episodes(cfg.calib_prompts, seed=cfg.seed + 2, model=str(lm_dir), reward_model=str(rm_dir),
                           prompts=str(prompts), max_new_tokens=cfg.max_new_tokens)  # fmt: skip
    scores = np.array([r["rm_score"] for r in rows])
    gold_scores = np.array([r["gold_score"] for r in rows])
    save_norm(
        rm_dir,
        float(scores.mean()),
        float(scores.std()),
        max_new_tokens=cfg.max_new_tokens,
        measured_on=f"{len(rows)} samples of pi_ref on the train prompts",
        reference_model=f"assets:{lm_dir.name}",  # the LM shipped beside it (textgym.rewards.calibrate.reference_name)
    )
    calibration = {
        "rm_mean": float(scores.mean()), "rm_std": float(scores.std()),
        "gold_mean": float(gold_scores.mean()), "spearman_rm_gold": spearman(scores, gold_scores),
    }  # fmt: skip
    samples = [
        {"prompt": r["prompt"], "response": r["response"], "rm": float(r["rm_score"]), "gold": float(r["gold_score"])}
        for r in rows[:12]
    ]
    return calibration, samples


# ---------------------------------------------------------------- main
def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Rebuild textgym's embedded tokenizer, LM and RM.")
    parser.add_argument("--quick", action="store_true", help="tiny models, for smoke tests")
    parser.add_argument("--out", type=Path, default=HERE, help="assets folder to write lm/, rm/ and data/ into")
    parser.add_argument("--corpus", type=Path, default=DATA / "reviews.jsonl")
    return parser.parse_args()


def main() -> None:
    """Run the build's steps in order (one seeded ``rng`` through them all); the report records each."""
    args = _parse_args()
    cfg = BuildConfig.quick() if args.quick else BuildConfig()
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    report: dict = {"config": asdict(cfg)}
    rng = random.Random(cfg.seed)
    data_out = args.out / "data"
    data_out.mkdir(parents=True, exist_ok=True)

    # -- corpus
    rows = load_corpus(args.corpus, cfg.seed)
    if args.quick:
        rows = rows[:800]
    train_rows, val_rows = split(rows)
    report["corpus"] = corpus_stats(rows)
    print("corpus:", report["corpus"])

    # -- tokenizer (lives in the LM folder; the RM copies it)
    tok_dir = args.out / ".tokenizer"
    tok = train_tokenizer([r["text"] for r in train_rows], cfg.vocab_size, tok_dir)

    # -- prompts: train prompts from train reviews, eval prompts from held-out reviews only
    train_prompts = write_prompts(cfg, train_rows, val_rows, tok, data_out)

    # -- SFT policy
    lm_dir = args.out / "lm"
    lm_rows = upsample_negatives(train_rows)
    report["lm"] = train_lm(cfg, tok, [r["text"] for r in lm_rows], [r["text"] for r in val_rows], lm_dir)
    report["lm"]["train_reviews_after_upsampling"] = len(lm_rows)
    print("lm:", report["lm"], f"{time.time() - t0:.0f}s")
    lm = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32).eval()

    # -- preference pairs judged by the gold scorer: corpus continuations + SFT samples
    sft = sft_items(cfg, lm, tok, train_prompts, rng)
    report["lm"]["sample_word_rate"] = real_word_rate([r for _, r, _ in sft], [r["text"] for r in rows])
    print("share of sampled words that occur in the corpus:", report["lm"]["sample_word_rate"])
    train_pairs, val_pairs = rm_pairs(cfg, train_rows, val_rows, sft, rng)
    write_pairs(data_out, train_pairs, val_pairs)
    rm_dir = args.out / "rm"
    result = train_reward_model(
        train_pairs, lm_dir, rm_dir, epochs=cfg.rm_epochs, lr=cfg.rm_lr, batch_size=cfg.rm_batch_size,
        val_pairs=val_pairs, seed=cfg.seed,
    )  # fmt: skip
    report["rm"] = asdict(result)
    print("rm:", {k: v for k, v in report["rm"].items() if k != "history"}, f"{time.time() - t0:.0f}s")

    # -- calibration under π_ref on the train prompts, and agreement with the gold scorer
    report["calibration"], report["samples"] = calibrate_rm(cfg, lm_dir, rm_dir, data_out / "prompts_train.txt")
    report["seconds"] = time.time() - t0
    (data_out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(tok_dir, ignore_errors=True)
    print("calibration:", report["calibration"], f"total {report['seconds']:.0f}s")


if __name__ == "__main__":
    main()
