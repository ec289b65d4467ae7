"""The reward-model protocol and the checks every score goes through.

A reward model scores a batch of finished episodes and returns one float per episode. It gets
the prompt and response as text *and* as token ids of the environment's tokenizer, so a model
sharing that tokenizer needs no re-tokenisation while any other model re-tokenises the text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from textgym.asset_paths import ASSETS
from textgym.errors import RewardModelError, short_repr
from textgym.timeouts import CallAbandoned, call_within

NORM_FILE = "textgym_reward.json"
FLOAT32_MAX = float(np.finfo(np.float32).max)  # the largest score the float32 rollout buffers hold

__all__ = [
    "Episodes",
    "NORM_FILE",
    "REFERENCE_KEY",
    "RewardModel",
    "RewardModelError",
    "RewardNorm",
    "load_norm",
    "reference_name",
    "save_norm",
    "score_checked",
    "stored_norm",
    "stored_reference",
    "verdicts_checked",
]


@dataclass(frozen=True)
class Episodes:
    """A batch of finished episodes handed to a reward model.

    Attributes:
        prompts: prompt texts.
        responses: response texts (without the EOS token).
        prompt_ids: prompt token ids as fed to the reference model (BOS included when the
            tokenizer adds one), one list per episode.
        response_ids: generated token ids, EOS included when the episode ended on it.
    """

    prompts: list[str]
    responses: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompts)


@runtime_checkable
class RewardModel(Protocol):
    """What the environment needs from a reward model.

    Attributes:
        name: a short name used in error messages and logs.
        shares_tokenizer: true when the model is a transformer over the policy's tokenizer,
            whose backbone can initialise the PPO critic (``backbone`` then returns it).
    """

    name: str
    shares_tokenizer: bool

    def score(self, episodes: Episodes) -> Sequence[float] | np.ndarray | torch.Tensor:
        """Return one score per episode."""
        ...


def _batch(episodes: Episodes, slots: Sequence[int] | None) -> str:
    where = f" (env slots {list(slots)})" if slots is not None else ""
    return f"a batch of {len(episodes)} episode(s){where}"


def score_checked(model: RewardModel, episodes: Episodes, slots: Sequence[int] | None = None,
                  timeout: float | None = None) -> np.ndarray:  # fmt: skip
    """Call ``model.score`` and check its output: finite floats, one per episode.

    Args:
        slots: the env slot of each episode, named in errors (episode i of a batch is not slot i).
        timeout: seconds to wait for ``model.score`` (None: no limit). A model with ``enforces_timeout = True``
            (an HTTP client) gets it as ``score(episodes, timeout=...)`` and keeps it itself.

    Raises:
        RewardModelError: naming the reward model, the batch and, for a bad value, the offending episode.
    """
    name = getattr(model, "name", type(model).__name__)
    raw = _call_score(model, name, episodes, slots, timeout)
    scores = _one_float_each(raw, name, len(episodes))
    _check_finite_in_float32(scores, name, episodes, slots)
    return scores


def verdicts_checked(model: RewardModel | None, episodes: Episodes) -> np.ndarray | None:
    """The reward model's verdicts — did each episode solve the task? — as float64 1.0/0.0, or None without any.

    Why apart from the score: a verifier's score may add shaping (a format bonus) or partial credit, so "score
    ≥ 1" is not its verdict; a model that knows right from wrong says so with ``verdicts(episodes) -> bools``.
    Called after ``score_checked`` has scored the same episodes, so a failure here is the model's own.

    Raises:
        RewardModelError: ``verdicts`` raised or did not return one bool per episode.
    """
    verdicts = getattr(model, "verdicts", None)
    if not callable(verdicts):
        return None
    name = getattr(model, "name", type(model).__name__)
    try:
        raw = verdicts(episodes)
    except Exception as err:
        raise RewardModelError(f"reward model {name!r}.verdicts raised {type(err).__name__}: {err}") from err
    out = np.asarray(raw)
    if out.dtype != np.bool_ or out.shape != (len(episodes),):
        raise RewardModelError(f"reward model {name!r}.verdicts returned {short_repr(raw)}; expected one bool per "
                               f"episode, shape ({len(episodes)},)")  # fmt: skip
    return out.astype(np.float64)


def _call_score(
    model: RewardModel, name: str, episodes: Episodes, slots: Sequence[int] | None, timeout: float | None
) -> Any:
    """``model.score(episodes)`` within ``timeout``; a failure or a hang becomes one :class:`RewardModelError`
    naming the model and the batch, so the env can undo the step and the user sees which scorer broke."""
    try:
        if getattr(model, "enforces_timeout", False):  # a remote model times its own request out
            return model.score(episodes, timeout=timeout)
        if timeout is None:
            return model.score(episodes)
        return call_within(lambda: model.score(episodes), timeout, "textgym-reward-model")
    except CallAbandoned:
        raise RewardModelError(
            f"reward model {name!r} did not return within reward_timeout={timeout} s on {_batch(episodes, slots)}; "
            "the call was abandoned and the step undone"
        ) from None
    except Exception as err:  # surface any failure with the model's name attached
        raise RewardModelError(
            f"reward model {name!r} raised {type(err).__name__}: {err} (scoring {_batch(episodes, slots)})"
        ) from err


def _one_float_each(raw: Any, name: str, n: int) -> np.ndarray:
    """``raw`` as float64 scores of shape ``(n,)``, or a :class:`RewardModelError` saying what came back instead.

    Only real numbers count: numpy would turn "1.0" into 1.0 and None into nan without a word, and
    True into 1.0 (a bool is a verdict, not a score: a verifier returns 1.0 or 0.0 explicitly).
    """
    if isinstance(raw, torch.Tensor):
        # float64, not float: a float32 cast would turn 1e39 into inf before the range check names it
        raw = raw.detach().cpu().numpy() if raw.dtype == torch.bool else raw.detach().double().cpu().numpy()
    try:
        scores = np.asarray(raw)
    except (TypeError, ValueError):  # ragged nesting
        scores = np.asarray(None)
    if scores.dtype.kind not in "iuf":
        shown = short_repr(raw)
        hint = " (bool values: return 1.0 or 0.0 to mean a score)" if scores.dtype.kind == "b" else ""
        raise RewardModelError(
            f"reward model {name!r} returned {type(raw).__name__} {shown}{hint}, which is not one float per episode; "
            f"expected a sequence, array or tensor of {n} real numbers"
        )
    scores = scores.astype(np.float64)
    if scores.ndim == 2 and scores.shape[1] == 1:
        scores = scores[:, 0]
    if scores.shape != (n,):
        raise RewardModelError(
            f"reward model {name!r} returned shape {scores.shape} for {n} episodes; "
            f"expected one float per episode, shape ({n},)"
        )
    return scores


def _check_finite_in_float32(scores: np.ndarray, name: str, episodes: Episodes, slots: Sequence[int] | None) -> None:
    """Refuse a score that is not finite in float32, naming its episode.

    Why float32: the rollout's buffers are float32, where 1e308 becomes inf and then NaN weights.
    """
    bad = np.flatnonzero(~np.isfinite(scores) | (np.abs(scores) > FLOAT32_MAX))
    if bad.size:
        i = int(bad[0])
        where = f"episode {i}" if slots is None else f"episode {i} of the batch (env slot {slots[i]})"
        raise RewardModelError(
            f"reward model {name!r} returned {scores[i]} for {where} (prompt={short_repr(episodes.prompts[i])}, "
            f"response={short_repr(episodes.responses[i])}); scores must be finite, also when stored as float32 "
            f"(|score| <= {FLOAT32_MAX:.4g}): this one is not finite in float32"
        )


class RewardNorm(NamedTuple):
    """A reward model's score mean/std under π_ref, and the env settings they were measured at.

    Standardising is only right at those settings: π_ref's responses at another length cap (or
    sampling temperature) score differently, so the env warns when they differ.
    """

    mean: float
    std: float
    max_new_tokens: int | None = None
    temperature: float | None = None


def stored_norm(model: Any, timeout: float | None = None) -> RewardNorm | None:
    """The score mean/std stored beside ``model`` (None: none stored); a plug-in's plain ``(mean, std)`` is accepted.

    A served model reads them from its server (``read_norm``), waiting at most ``timeout`` seconds (the env's
    ``reward_timeout``; None: the client's own), and raises :class:`RewardModelError` when it cannot.
    """
    read = getattr(model, "read_norm", None)
    stored = read(timeout) if callable(read) else getattr(model, "norm", None)
    if stored is not None and not isinstance(stored, RewardNorm):
        stored = RewardNorm(*stored)
    return stored


def load_norm(folder: str | Path) -> RewardNorm | None:
    """The :class:`RewardNorm` stored beside a reward model, if any."""
    path = Path(folder) / NORM_FILE
    if not path.exists():
        return None
    stats = json.loads(path.read_text())
    return RewardNorm(float(stats["mean"]), float(stats["std"]), stats.get("max_new_tokens"), stats.get("temperature"))


def save_norm(folder: str | Path, mean: float, std: float, *, max_new_tokens: int, temperature: float = 1.0,
              **extra) -> None:  # fmt: skip
    """Store normalisation statistics, with the settings they were measured at, beside a reward model (atomically)."""
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise ValueError(f"normalisation stats must be finite with std > 0, got mean={mean}, std={std}")
    path = Path(folder) / NORM_FILE
    tmp = path.with_suffix(".tmp")
    stats = {"mean": mean, "std": std, "max_new_tokens": max_new_tokens, "temperature": temperature, **extra}
    tmp.write_text(json.dumps(stats, indent=2) + "\n")
    tmp.replace(path)


REFERENCE_KEY = "reference_model"  # the stats file's field naming the π_ref its mean/std were measured under


def reference_name(model: Any) -> str:
    """How a stats file names π_ref: ``assets:lm`` for an embedded model (its path differs per install), else
    the absolute folder, else the name it was loaded by (``model``: a loaded model or its name_or_path)."""
    source = str(getattr(model, "name_or_path", model))
    path = Path(source)
    if not path.exists():
        return source
    path, assets = path.resolve(), ASSETS.resolve()
    return f"assets:{path.relative_to(assets).as_posix()}" if path.is_relative_to(assets) else str(path)


def stored_reference(reward_model: Any) -> str | None:
    """The π_ref a reward model's stored mean/std were measured under (:func:`reference_name`); None: not recorded."""
    source = getattr(reward_model, "source", None)
    path = Path(source) / NORM_FILE if isinstance(source, (str, Path)) else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8")).get(REFERENCE_KEY)
