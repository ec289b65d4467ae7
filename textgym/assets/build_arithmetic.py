"""Build the embedded arithmetic task: problems, a character tokenizer and a tiny π_ref with room to improve.

``python -m textgym.assets.build_arithmetic [--out DIR]`` writes ``DIR/arith_lm`` (a Llama of about
0.1M parameters, HF folder with its tokenizer) and ``DIR/data/arith_{train,eval}.txt``. Problems
are ``"a+b="`` with 0 <= a, b <= 99, answered ``"c"`` + EOS, shuffled with a fixed seed and split
three ways: 4,000 for the supervised fine-tuning of π_ref, 4,000 for RL training ("train"),
2,000 for evaluation. Disjoint by construction, and RL trains on problems π_ref never saw, as
eval does: what RL gains there is arithmetic learnt, not answers memorised.

π_ref is trained with teacher forcing on the answers of the SFT problems and stopped as soon
as its exact-answer accuracy at temperature 1 on the eval problems reaches ``target_accuracy``
(checked every ``check_every`` steps), so that RL has room to improve (the task asks for 20–60 %).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from textgym.files import save_folder_atomically

HERE = Path(__file__).parent
CHARS = list("0123456789+=")


@dataclass
class ArithmeticBuild:
    """Sizes and budgets of the arithmetic π_ref (defaults: the shipped build)."""

    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    batch_size: int = 64
    lr: float = 3e-3
    max_steps: int = 4000
    check_every: int = 100
    target_accuracy: float = 0.35
    eval_samples: int = 400


def problems() -> tuple[list[str], list[str], list[str]]:
    """All ``"a+b="`` prompts in a fixed random order, split into (SFT 4,000, RL train 4,000, eval 2,000)."""
    allp = [f"{a}+{b}=" for a in range(100) for b in range(100)]
    random.Random(0).shuffle(allp)  # a split on digits (e.g. b mod 5) would hide some units digits from SFT
    return allp[:4000], allp[4000:8000], allp[8000:]


def answer(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return str(int(a) + int(b))


def make_tokenizer():
    """One token per character: PAD 0, BOS 1, EOS 2, then the digits, ``+`` and ``=``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", *CHARS])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    tok.model_max_length = 16
    return tok


def make_model(cfg: ArithmeticBuild, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tok), hidden_size=cfg.hidden_size, intermediate_size=2 * cfg.hidden_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_heads, max_position_embeddings=16, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return LlamaForCausalLM(config)


def batch(tok, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``<bos> a+b= c <eos>`` rows; labels only on the answer and EOS (the prompt is given)."""
    rows, labels = [], []
    for p in prompts:
        prompt_ids = tok(p)["input_ids"]
        answer_ids = tok(answer(p), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return ids, (ids != 0).long(), lab


@torch.no_grad()
def accuracy(model, tok, prompts: list[str], seed: int) -> float:
    """Exact-answer accuracy of samples at temperature 1 (left-padded prompts, up to 4 new tokens)."""
    from textgym.models import left_pad

    model.eval()
    ids, mask = left_pad(tok, [tok(p)["input_ids"] for p in prompts])
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=4, pad_token_id=0, eos_token_id=2)  # fmt: skip
    texts = tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    return sum(t == answer(p) for t, p in zip(texts, prompts)) / len(prompts)


def train(cfg: ArithmeticBuild, tok, sft_prompts: list[str], eval_prompts: list[str]) -> tuple[object, dict]:
    """Teacher-forced training until the eval accuracy at temperature 1 reaches the target."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    model = make_model(cfg, tok)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    probe = rng.sample(eval_prompts, cfg.eval_samples)
    history = []
    for step in range(1, cfg.max_steps + 1):
        model.train()
        ids, mask, labels = batch(tok, rng.sample(sft_prompts, cfg.batch_size))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        if step % cfg.check_every == 0:
            acc = accuracy(model, tok, probe, cfg.seed)
            history.append({"step": step, "loss": round(loss.item(), 4), "eval_accuracy_t1": acc})
            print(history[-1], flush=True)
            if acc >= cfg.target_accuracy:
                break
    return model, {"history": history, "steps": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE), help="folder to write arith_lm/ and data/ into")
    parser.add_argument("--max-steps", type=int, default=ArithmeticBuild.max_steps)
    args = parser.parse_args()
    cfg = ArithmeticBuild(max_steps=args.max_steps)
    out, start = Path(args.out), time.time()
    sft_prompts, train_prompts, eval_prompts = problems()
    tok = make_tokenizer()
    model, report = train(cfg, tok, sft_prompts, eval_prompts)
    report |= {"config": asdict(cfg), "parameters": sum(p.numel() for p in model.parameters()),
               "eval_accuracy_t1_all": accuracy(model, tok, eval_prompts, cfg.seed + 1),
               "train_accuracy_t1_all": accuracy(model, tok, train_prompts, cfg.seed + 2),
               "sft_problems": len(sft_prompts), "train_problems": len(train_prompts),
               "eval_problems": len(eval_prompts), "seconds": round(time.time() - start, 1)}  # fmt: skip
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name, prompts in (("arith_train.txt", train_prompts), ("arith_eval.txt", eval_prompts)):
        (out / "data" / name).write_text("\n".join(prompts) + "\n")
    save_folder_atomically(out / "arith_lm", lambda t: (model.save_pretrained(t), tok.save_pretrained(t),
                                                         (t / "build_report.json").write_text(
                                                             json.dumps(report, indent=2) + "\n")))  # fmt: skip
    print({k: v for k, v in report.items() if k != "history"})


if __name__ == "__main__":
    main()
