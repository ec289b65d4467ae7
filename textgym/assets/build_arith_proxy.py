"""Build the learned proxy of TextArithmetic-v0's verifier: a small classifier of π_ref's right and wrong answers.

``python -m textgym.assets.build_arith_proxy [--out DIR]`` writes ``DIR/arith_proxy_rm``, a Hugging Face
sequence classifier (``num_labels=1``: the logit is the score) that ``reward_model="arithmetic-proxy"``
loads. The gold of ``TextArithmetic-v0`` is the exact answer; this proxy plays the part a learned reward
model plays in RLHF, so that over-optimisation (Gao et al., 2023) can be measured on a task whose
gold is exact: optimise the proxy, watch ``gold_score``.

Steps: sample π_ref through ``TextArithmetic-v0`` on the RL-train problems, label every episode by
``ArithmeticVerifier`` (0/1), hold out a share of the *problems* (the held-out metrics are on problems
the proxy never saw, as RL on the eval split will be), train π_ref's body with a fresh scalar head by
binary cross-entropy, stop early on the held-out loss and keep the best epoch. The folder also holds
the proxy's score mean/std under π_ref (``normalize_reward=True``) and ``build_report.json``.

The proxy is deliberately of π_ref's own size (two layers, hidden 64, 83k parameters), and it is weak.
Pooled at the EOS, two layers cannot reuse π_ref's arithmetic (π_ref computes each digit one position
before it is written; comparing the two at the EOS takes a layer more), and from 1-bit labels a sum is
learnt slowly (extra layers did not learn it within the budget either). It learns which problems π_ref
gets right and how large a sum is: held-out ROC AUC about 0.62 over π_ref's samples, but about 0.53
between a right and a wrong answer to the *same* problem, the comparison RL makes (``within_problem_auc``
in the report). So RL against it has little true signal and much to exploit (no RL run measured it yet).
Variants measured while choosing (held-out AUC): a frozen-body linear probe 0.53; 32k samples 0.64; one
or two extra layers on top 0.62-0.65; π_ref's own response log-likelihood, not a classifier, 0.91 (the
information is there; this classifier does not reach it).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from textgym.files import save_folder_atomically

HERE = Path(__file__).parent
ENV_ID = "TextArithmetic-v0"
MAX_NEW_TOKENS = 4  # TextArithmetic-v0's length cap: the proxy and its mean/std are measured there


@dataclass
class ArithProxyBuild:
    """Sample, split and training settings of the arithmetic proxy (defaults: the shipped build).

    Attributes:
        seed: seeds sampling, the split, the batch order and torch.
        episodes: π_ref samples on the 4,000 RL-train problems (about two per problem).
        num_envs: env slots sampling in parallel.
        heldout_fraction: share of the sampled problems held out for early stopping and the report.
        batch_size, lr, weight_decay: AdamW on every parameter, the learning rate decayed linearly.
        max_epochs, patience: stop once the held-out loss has not improved for ``patience`` epochs.
        calibration_episodes: fresh π_ref samples (seed + 1) the stored mean/std are measured on.
    """

    seed: int = 0
    episodes: int = 8192
    num_envs: int = 256
    heldout_fraction: float = 0.2
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    max_epochs: int = 24
    patience: int = 4
    calibration_episodes: int = 2048

    def __post_init__(self):
        for name in ("episodes", "num_envs", "batch_size", "max_epochs", "patience", "calibration_episodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction={self.heldout_fraction!r} must be in (0, 1)")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} must be >= 0")


# ---------------------------------------------------------------- metrics (pure)


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of ``x`` ``(N,)``, ties sharing their mean rank (as Spearman and Mann–Whitney need)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"x has shape {x.shape}; expected one dimension (N,)")
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    _, group, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(group, weights=ranks) / counts)[group]


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score of a random positive > score of a random negative), ties counting one half (Mann–Whitney U).

    Raises:
        ValueError: shapes differ, labels are not 0/1, or one of the two classes is empty.
    """
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    if scores.shape != labels.shape or scores.ndim != 1:
        raise ValueError(f"scores {scores.shape} and labels {labels.shape} must be two arrays of the same shape (N,)")
    if not np.isin(labels, (0, 1)).all():
        raise ValueError(f"labels must be 0 or 1, got values {sorted(set(labels.tolist()))[:5]}")
    positives, negatives = int(labels.sum()), int((1 - labels).sum())
    if positives == 0 or negatives == 0:
        raise ValueError(f"labels hold {positives} positives and {negatives} negatives; the AUC needs both")
    rank_sum = average_ranks(scores)[labels == 1].sum()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


def within_group_auc(scores: np.ndarray, labels: np.ndarray, groups: list) -> float:
    """P(positive > negative) over the pairs that share a group (a problem), ties one half; NaN if there are none.

    Why beside :func:`roc_auc`: pooled over problems, a proxy scores well by knowing which problems π_ref
    gets right; RL compares answers to the *same* problem, so this is the number that tells it apart.
    """
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels)
    if not len(scores) == len(labels) == len(groups):
        raise ValueError(f"scores ({len(scores)}), labels ({len(labels)}) and groups ({len(groups)}) differ in length")
    _, group_of = np.unique(np.asarray(groups), return_inverse=True)
    wins = pairs = 0.0
    for k in range(group_of.max() + 1 if len(groups) else 0):
        rows = group_of == k
        positives, negatives = int(labels[rows].sum()), int((1 - labels[rows]).sum())
        if positives and negatives:
            wins += roc_auc(scores[rows], labels[rows]) * positives * negatives
            pairs += positives * negatives
    return wins / pairs if pairs else float("nan")


def correlations(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Point-biserial (Pearson with the 0/1 label) and Spearman (Pearson of ranks) correlations."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    return {
        "point_biserial": float(np.corrcoef(scores, labels)[0, 1]),
        "spearman": float(np.corrcoef(average_ranks(scores), average_ranks(labels))[0, 1]),
    }


# ---------------------------------------------------------------- data


def sample_labelled(cfg: ArithProxyBuild) -> list[dict]:
    """π_ref's episodes on the RL-train problems, ``gold_score`` being the verifier's 0/1 label."""
    from textgym.assets import ARITH_TRAIN
    from textgym.rewards.calibrate import sample_episodes

    return sample_episodes(cfg.episodes, cfg.num_envs, cfg.seed, env_id=ENV_ID, prompts=str(ARITH_TRAIN),
                           reward_model="arithmetic", max_new_tokens=MAX_NEW_TOKENS)  # fmt: skip


def split_by_problem(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows, a problem's samples all on one side: held-out problems are unseen ones."""
    problems = sorted({row["prompt"] for row in rows})
    random.Random(seed).shuffle(problems)
    heldout = set(problems[: max(1, round(len(problems) * fraction))])
    return [r for r in rows if r["prompt"] not in heldout], [r for r in rows if r["prompt"] in heldout]


def encode(tok, rows: list[dict]) -> list[tuple[list[int], float]]:
    """(token ids as the env hands an episode to a reward model sharing its tokenizer, 0/1 label)."""
    from textgym.rewards.training import encode_episode

    return [(encode_episode(tok, row["prompt"], row["response"]), row["gold_score"]) for row in rows]


# ---------------------------------------------------------------- model


def make_classifier():
    """π_ref's body and tokenizer with a zero scalar head: every text starts at logit 0 (probability 1/2)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from textgym.assets import ARITH_LM
    from textgym.models import quiet_transformers

    quiet_transformers()  # the head is missing from π_ref's folder by design: no load report about it
    tok = AutoTokenizer.from_pretrained(ARITH_LM)
    model = AutoModelForSequenceClassification.from_pretrained(ARITH_LM, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    torch.nn.init.zeros_(model.score.weight)
    return model, tok


def logits(model, tok, batch: list[tuple[list[int], float]]) -> torch.Tensor:
    """``(B,)`` logits pooled at the EOS, left-padded with position ids from the mask as HFRewardModel does."""
    from textgym.functional import position_ids_from_mask
    from textgym.models import left_pad

    ids, mask = left_pad(tok, [row for row, _ in batch])
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits[:, 0]


@torch.no_grad()
def predict(model, tok, data: list[tuple[list[int], float]], batch_size: int = 1024) -> np.ndarray:
    model.eval()
    return torch.cat([logits(model, tok, data[i : i + batch_size]) for i in range(0, len(data), batch_size)]).numpy()


def heldout_metrics(scores: np.ndarray, labels: np.ndarray, problems: list[str]) -> dict[str, float]:
    """BCE, accuracy at logit 0, ROC AUC pooled and within a problem, correlations with the verifier."""
    loss = F.binary_cross_entropy_with_logits(torch.from_numpy(scores), torch.from_numpy(labels)).item()
    return {"loss": loss, "accuracy": float(((scores > 0) == (labels == 1)).mean()),
            "roc_auc": roc_auc(scores, labels), "within_problem_auc": within_group_auc(scores, labels, problems),
            **correlations(scores, labels)}  # fmt: skip


def train(cfg: ArithProxyBuild, model, tok, train_rows: list[dict], heldout_rows: list[dict]) -> list[dict]:
    """BCE epochs with early stopping on the held-out loss; ``model`` ends with the best epoch's weights."""
    from transformers import get_linear_schedule_with_warmup

    rng = random.Random(cfg.seed)
    data, held = encode(tok, train_rows), encode(tok, heldout_rows)
    held_labels, held_problems = np.array([label for _, label in held]), [r["prompt"] for r in heldout_rows]
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.max_epochs * math.ceil(len(data) / cfg.batch_size)
    sched = get_linear_schedule_with_warmup(optim, num_warmup_steps=steps // 20, num_training_steps=steps)
    best, best_state, history = {"loss": math.inf, "epoch": 0}, None, []
    for epoch in range(1, cfg.max_epochs + 1):
        model.train()
        rng.shuffle(data)
        for start in range(0, len(data), cfg.batch_size):
            batch = data[start : start + cfg.batch_size]
            loss = F.binary_cross_entropy_with_logits(logits(model, tok, batch), torch.tensor([y for _, y in batch]))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
        metrics = heldout_metrics(predict(model, tok, held), held_labels, held_problems)
        history.append({"epoch": epoch, **{k: round(v, 4) for k, v in metrics.items()}})
        print(history[-1], flush=True)
        if metrics["loss"] < best["loss"]:
            best, best_state = {"loss": metrics["loss"], "epoch": epoch}, copy.deepcopy(model.state_dict())
        elif epoch - best["epoch"] >= cfg.patience:
            break
    model.load_state_dict(best_state)
    return history


# ---------------------------------------------------------------- build


def write_folder(cfg: ArithProxyBuild, model, tok, report: dict, start: float, folder: Path) -> None:
    """Weights (float32: 83k parameters), tokenizer, the mean/std under π_ref measured through the env, report."""
    from textgym.assets import ARITH_LM
    from textgym.rewards import save_norm
    from textgym.rewards.calibrate import calibrate, reference_name

    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    mean, std = calibrate(cfg.calibration_episodes, cfg.num_envs, cfg.seed + 1, env_id=ENV_ID,
                          reward_model=str(folder), max_new_tokens=MAX_NEW_TOKENS)  # fmt: skip
    save_norm(folder, mean, std, max_new_tokens=MAX_NEW_TOKENS, reference_model=reference_name(ARITH_LM),
              measured_on=f"{cfg.calibration_episodes} fresh samples of pi_ref on the RL-train problems")  # fmt: skip
    report["norm_under_pi_ref"] = {"mean": mean, "std": std}
    report["seconds"] = round(time.time() - start, 1)
    (folder / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")


def build(cfg: ArithProxyBuild, out: Path) -> dict:
    """Sample, split, train, measure and write ``out``; returns the report."""
    torch.manual_seed(cfg.seed)
    start = time.time()
    rows = sample_labelled(cfg)
    train_rows, heldout_rows = split_by_problem(rows, cfg.heldout_fraction, cfg.seed)
    sampled = time.time() - start
    model, tok = make_classifier()
    history = train(cfg, model, tok, train_rows, heldout_rows)
    held_scores = predict(model, tok, encode(tok, heldout_rows))
    held_labels, held_problems = np.array([r["gold_score"] for r in heldout_rows]), [r["prompt"] for r in heldout_rows]
    report = {
        "samples": len(rows), "train_samples": len(train_rows), "heldout_samples": len(heldout_rows),
        "train_problems": len({r["prompt"] for r in train_rows}),
        "heldout_problems": len({r["prompt"] for r in heldout_rows}),
        "right_share": float(np.mean([r["gold_score"] for r in rows])),
        "heldout": {k: round(v, 4) for k, v in heldout_metrics(held_scores, held_labels, held_problems).items()},
        "best_epoch": min(history, key=lambda h: h["loss"])["epoch"], "history": history,
        "parameters": sum(p.numel() for p in model.parameters()), "config": asdict(cfg),
        "seconds_sampling": round(sampled, 1),
    }  # fmt: skip
    save_folder_atomically(out, lambda folder: write_folder(cfg, model, tok, report, start, folder))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "arith_proxy_rm"), help="folder to write the proxy into")
    parser.add_argument("--seed", type=int, default=ArithProxyBuild.seed)
    args = parser.parse_args()
    torch.set_num_threads(1)  # batches of 64 short rows gain nothing from threads; the result no longer depends on them
    report = build(ArithProxyBuild(seed=args.seed), Path(args.out))
    print({k: v for k, v in report.items() if k not in ("history", "config")})


if __name__ == "__main__":
    main()
