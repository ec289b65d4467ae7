"""A weighted sum of reward models, each part resolved as ``reward_model=`` resolves it.

Why a module of its own: resolving a part needs :func:`~textgym.rewards.registry.make_reward_model`,
and the registry imports the built-ins; beside them this class would make an import cycle.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from textgym.errors import short_repr
from textgym.rewards.base import Episodes, score_checked
from textgym.rewards.registry import make_reward_model

__all__ = ["WeightedSumReward"]


class WeightedSumReward:
    """Σ_i w_i · r_i(episodes) of several reward models (each output checked on its own).

    Each part's reward model may be anything ``reward_model=`` accepts (a name such as ``"vader"``,
    a folder, ``"module:attr"``, an object with ``score``, a function); it is resolved and loaded
    here, so a bad part fails at construction, not at the first episode's end.

    Args:
        parts: ``[(weight, reward_model), ...]``, weights finite floats.

    Raises:
        ValueError: ``parts`` is empty, a part is not a pair, a weight is not a finite float, or a
            reward model cannot be resolved (the error names ``parts[i]``).
    """

    def __init__(self, parts: Sequence[tuple[float, object]]):
        if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or not parts:
            raise ValueError(f"parts={short_repr(parts)} must be a non-empty list of (weight, reward_model) pairs")
        self.parts = [_weighted_part(i, part) for i, part in enumerate(parts)]
        self.name = " + ".join(f"{w:g}*{getattr(m, 'name', type(m).__name__)}" for w, m in self.parts)
        self.shares_tokenizer = False

    def bind(self, tokenizer) -> None:
        for _, model in self.parts:
            if hasattr(model, "bind"):
                model.bind(tokenizer)

    def score(self, episodes: Episodes) -> np.ndarray:
        return sum(w * score_checked(m, episodes) for w, m in self.parts)


def _weighted_part(i: int, part: object) -> tuple[float, object]:
    """``parts[i]`` as ``(float weight, resolved reward model)``, or one ValueError naming it."""
    if isinstance(part, (str, bytes)) or not isinstance(part, Sequence) or len(part) != 2:
        raise ValueError(f"parts[{i}]={short_repr(part)} must be a (weight, reward_model) pair")
    weight, model = part
    real = isinstance(weight, (int, float, np.integer, np.floating)) and not isinstance(weight, (bool, np.bool_))
    if not real or not np.isfinite(weight):
        raise ValueError(f"parts[{i}] has weight={weight!r}; weights must be finite floats")
    return float(weight), make_reward_model(model, f"parts[{i}]")
