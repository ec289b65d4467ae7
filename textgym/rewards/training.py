"""Training a Bradley–Terry reward model from preference pairs.

The loss is −log σ(r(x, y_chosen) − r(x, y_rejected)) (Bradley & Terry, 1952; Ouyang et al.,
2022). The model is a causal-LM backbone with a fresh scalar head
(``AutoModelForSequenceClassification`` with ``num_labels=1``), pooled at the last token —
the EOS appended to every response, as the environment feeds finished episodes.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import get_linear_schedule_with_warmup

from textgym.files import save_folder_atomically
from textgym.functional import position_ids_from_mask
from textgym.models import left_pad

__all__ = ["PreferencePair", "RMTrainResult", "encode_episode", "load_pairs", "train_reward_model"]


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


@dataclass
class RMTrainResult:
    """What a reward-model training run measured (held-out accuracy on the best epoch)."""

    val_accuracy: float
    val_loss: float
    train_pairs: int
    val_pairs: int
    epochs_run: int
    history: list[dict]


def load_pairs(path: str | Path) -> list[PreferencePair]:
    """Read JSONL lines ``{"prompt", "chosen", "rejected"}``; any bad line raises naming its number."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"pairs={str(path)!r} does not exist")
    pairs = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: invalid JSON ({err.msg})") from err
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected an object with prompt, chosen, rejected")
        for key in ("prompt", "chosen", "rejected"):
            if key not in row:
                raise ValueError(f"{path}:{n}: missing key {key!r}")
            if not isinstance(row[key], str):
                raise ValueError(f"{path}:{n}: {key!r} must be a string, got {type(row[key]).__name__}")
        if not row["chosen"].strip() or not row["rejected"].strip():
            raise ValueError(f"{path}:{n}: 'chosen' and 'rejected' must be non-empty strings")
        pairs.append(PreferencePair(row["prompt"], row["chosen"], row["rejected"]))
    if not pairs:
        raise ValueError(f"pairs={str(path)!r} holds no preference pairs")
    return pairs


def encode_episode(tokenizer, prompt: str, response: str) -> list[int]:
    """Token ids as the environment hands a finished episode to a reward model sharing its tokenizer.

    prompt (with BOS when the tokenizer adds one) + response + EOS; text such as ``"<pad>"`` is
    encoded as text, never as the special token (as the environment encodes prompts).
    """
    ids = tokenizer(prompt, split_special_tokens=True)["input_ids"] if prompt else []
    if not ids:
        ids = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]
    response_ids = tokenizer(response, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids + response_ids + [tokenizer.eos_token_id]


def _rewards(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits[:, 0]


@torch.no_grad()
def _evaluate(model, data: list[tuple[list[int], list[int]]], tokenizer, batch_size: int) -> tuple[float, float]:
    model.eval()
    losses, correct = [], 0
    for start in range(0, len(data), batch_size):
        chunk = data[start : start + batch_size]
        ids, mask = left_pad(tokenizer, [c for c, _ in chunk] + [r for _, r in chunk])
        r = _rewards(model, ids, mask)
        margin = r[: len(chunk)] - r[len(chunk) :]
        losses.append(-F.logsigmoid(margin).sum().item())
        correct += (margin > 0).sum().item()
    return sum(losses) / len(data), correct / len(data)


def train_reward_model(
    pairs: list[PreferencePair],
    backbone: str | Path,
    out: str | Path,
    *,
    epochs: int = 3,
    lr: float = 3e-4,
    batch_size: int = 32,
    val_fraction: float = 0.1,
    val_pairs: list[PreferencePair] | None = None,
    patience: int = 1,
    seed: int = 0,
    save_dtype: torch.dtype = torch.float16,
    progress: bool = True,
) -> RMTrainResult:
    """Train a Bradley–Terry reward model and save it as a Hugging Face folder at ``out``.

    Args:
        pairs: training pairs (a held-out split of ``val_fraction`` is taken from them unless
            ``val_pairs`` is given).
        backbone: a causal-LM folder; its body initialises the reward model and its tokenizer
            is saved with it (so the result shares the policy tokenizer).
        out: destination folder, replaced atomically.
        epochs, lr, batch_size, patience: AdamW schedule; training stops early once the
            held-out loss has not improved for ``patience`` epochs and the best epoch is kept.
        save_dtype: storage precision of the saved weights.
    """
    from transformers import AutoTokenizer

    if not pairs:
        raise ValueError("pairs is empty")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(backbone)
    model = _init_reward_model(backbone, tokenizer)
    train, val_pairs = _held_out_split(pairs, val_pairs, val_fraction, rng)
    train_data, val_data = _encode_pairs(tokenizer, train), _encode_pairs(tokenizer, val_pairs)
    optim, sched = _adamw_with_warmup(model, lr, steps=epochs * math.ceil(len(train_data) / batch_size))
    best = (math.inf, 0.0, None)
    history, bad_epochs = [], 0
    for epoch in range(epochs):
        rng.shuffle(train_data)
        _train_epoch(model, tokenizer, train_data, batch_size, optim, sched, f"rm epoch {epoch + 1}", progress)
        val_loss, val_acc = _evaluate(model, val_data, tokenizer, 2 * batch_size)
        history.append({"epoch": epoch + 1, "val_loss": val_loss, "val_accuracy": val_acc})
        if progress:
            print(f"rm epoch {epoch + 1}: held-out loss {val_loss:.4f}, accuracy {val_acc:.4f}")
        if val_loss < best[0]:
            best, bad_epochs = (val_loss, val_acc, {k: v.clone() for k, v in model.state_dict().items()}), 0
        else:
            bad_epochs += 1
            if bad_epochs >= patience:
                break
    _save_best(model, best[2], tokenizer, out, save_dtype)
    return RMTrainResult(best[1], best[0], len(train_data), len(val_data), len(history), history)


def _init_reward_model(backbone: str | Path, tokenizer):
    """The backbone's body under a fresh scalar head; ``pad_token_id`` tells it which tokens are padding, so it
    pools at the last real token."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(backbone, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    torch.nn.init.zeros_(model.score.weight)  # start at r = 0 for every text: no prior preference
    return model


def _held_out_split(
    pairs: list[PreferencePair], val_pairs: list[PreferencePair] | None, val_fraction: float, rng: random.Random
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """(train, held-out): ``val_pairs`` when given, else a shuffled ``val_fraction`` of ``pairs`` (at least one),
    so early stopping always has a held-out loss to watch."""
    train = list(pairs)
    if val_pairs is None:
        rng.shuffle(train)
        n_val = max(1, int(len(train) * val_fraction))
        val_pairs, train = train[:n_val], train[n_val:]
    return train, val_pairs


def _encode_pairs(tokenizer, pairs: list[PreferencePair]) -> list[tuple[list[int], list[int]]]:
    """(chosen ids, rejected ids) per pair, each encoded as the env hands a finished episode to the RM."""
    return [
        (encode_episode(tokenizer, p.prompt, p.chosen), encode_episode(tokenizer, p.prompt, p.rejected)) for p in pairs
    ]


def _adamw_with_warmup(model, lr: float, steps: int):
    """AdamW and its schedule: linear warmup over a tenth of the steps (at most 50), then linear decay to 0."""
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(optim, num_warmup_steps=min(50, steps // 10), num_training_steps=steps)
    return optim, sched


def _train_epoch(model, tokenizer, data, batch_size: int, optim, sched, desc: str, progress: bool) -> None:
    """One pass over ``data`` in order: the caller shuffles it, with the run's seeded ``rng``."""
    from tqdm.auto import tqdm

    model.train()
    bar = tqdm(range(0, len(data), batch_size), desc=desc, disable=not progress)
    for start in bar:
        chunk = data[start : start + batch_size]
        ids, mask = left_pad(tokenizer, [c for c, _ in chunk] + [r for _, r in chunk])
        r = _rewards(model, ids, mask)  # (2b,): chosen then rejected
        loss = -F.logsigmoid(r[: len(chunk)] - r[len(chunk) :]).mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")


def _save_best(model, state: dict, tokenizer, out: str | Path, save_dtype: torch.dtype) -> None:
    """Save the best epoch's weights at ``save_dtype`` with the backbone's tokenizer, so the env loads the
    folder as it is; ``out`` is replaced atomically."""
    model.load_state_dict(state)
    model.to(save_dtype)
    save_folder_atomically(out, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
