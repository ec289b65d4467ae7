"""Turning a ``reward_model=`` argument into a reward model.

Routes, tried in this order:

1. an object with a ``score`` method (used as is) or a plain callable ``f(prompts, responses)``;
2. a registered name (``"default"``, ``"vader"`` and whatever ``register`` added);
3. a name published by an installed package in the entry-point group ``textgym.reward_models``;
4. a ``"package.module:attr"`` string (the attribute is a reward model, a factory or a callable);
5. a Hugging Face sequence-classification folder or hub id.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from textgym.rewards.base import RewardModel
from textgym.rewards.builtin import CallableRewardModel, HFRewardModel, LengthReward, VaderScorer

ENTRY_POINT_GROUP = "textgym.reward_models"

__all__ = ["ENTRY_POINT_GROUP", "make_reward_model", "register", "registered_names"]

_REGISTRY: dict[str, Callable[..., RewardModel]] = {}


def register(name: str, factory: Callable[..., RewardModel] | None = None):
    """Register a reward-model factory under ``name`` (usable as a decorator)."""

    def deco(f: Callable[..., RewardModel]) -> Callable[..., RewardModel]:
        _REGISTRY[name] = f
        return f

    return deco(factory) if factory is not None else deco


def _default(**kwargs: Any) -> RewardModel:
    from textgym.models import DEFAULT_RM

    return HFRewardModel(DEFAULT_RM, **kwargs)


register("default", _default)
register("vader", lambda **kwargs: VaderScorer())
register("length", lambda **kwargs: LengthReward())


def registered_names() -> list[str]:
    """Names usable as ``reward_model=``: registered ones and installed entry points."""
    return sorted(set(_REGISTRY) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def _from_object(obj: Any, name: str) -> RewardModel:
    """A reward model as is, a class/factory producing one, or a plain scoring callable."""
    if hasattr(obj, "score"):
        if isinstance(obj, type):
            obj = obj()
        if not hasattr(obj, "name"):
            obj.name = name
        if not hasattr(obj, "shares_tokenizer"):
            obj.shares_tokenizer = False
        return obj
    if callable(obj):
        return CallableRewardModel(obj, name=name)
    raise TypeError(f"reward_model={name!r} resolved to {type(obj).__name__}, which has no score() and is not callable")


def make_reward_model(spec: Any, argument: str = "reward_model", **kwargs: Any) -> RewardModel:
    """Resolve ``spec`` through the routes above; ``kwargs`` go to HF models and factories.

    Raises:
        ValueError / FileNotFoundError: naming ``argument``, the value and what is allowed.
    """
    if spec is None:
        spec = "default"
    if not isinstance(spec, (str, os.PathLike)):
        return _from_object(spec, getattr(spec, "name", None) or getattr(spec, "__name__", type(spec).__name__))
    text = os.fspath(spec)
    if text in _REGISTRY:
        return _REGISTRY[text](**kwargs)
    eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == text]
    if eps:
        return _from_object(eps[0].load(), text)
    if ":" in text and not Path(text).exists():
        module_name, _, attr = text.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"{argument}={text!r}: module {module_name!r} cannot be imported ({err})") from err
        if not hasattr(module, attr):
            raise ValueError(f"{argument}={text!r}: module {module_name!r} has no attribute {attr!r}")
        return _from_object(getattr(module, attr), text)
    if Path(text).expanduser().exists() or text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return HFRewardModel(text, **kwargs)
    raise ValueError(
        f"{argument}={text!r} is not a registered name ({', '.join(registered_names())}), "
        "an existing folder, a hub id 'org/name' or a 'package.module:attr' string"
    )
