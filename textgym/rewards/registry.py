"""Turning a ``reward_model=`` argument into a reward model.

Routes, tried in this order:

1. an object with a ``score`` method (used as is) or a plain callable ``f(prompts, responses)``;
   an ``http(s)://HOST:PORT/get_reward`` (OpenRLHF) or ``.../score`` (``textgym serve-rm``) URL: a
   reward model served over HTTP (:mod:`textgym.rewards.http`);
2. ``"reasoning-gym:<dataset>[?options]"``: that reasoning-gym dataset's ``score_answer``, with its verdicts
   (:mod:`textgym.rewards.reasoning_gym_verifier`; reasoning-gym is imported only then);
3. a registered name (``"default"``, ``"vader"`` and whatever ``register`` added);
4. a name published by an installed package in the entry-point group ``textgym.reward_models``;
5. a ``"package.module:attr"`` string (the attribute is a reward model, a factory or a callable); the
   module is looked up on ``sys.path`` and then in the working directory, as ``python -m`` would;
6. a Hugging Face sequence-classification folder or hub id.

A registered factory is called with the keyword arguments its signature names (all of them when it
takes ``**kwargs``, none for ``lambda: MyRM()``); the env offers ``device`` (the ``torch.device`` π_ref
runs on), so ``def factory(device="cpu")`` gets it.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from textgym.asset_paths import DEFAULT_RM
from textgym.imports import import_module_named
from textgym.reasoning_gym_task import is_spec
from textgym.rewards.base import RewardModel
from textgym.rewards.builtin import CallableRewardModel, HFRewardModel, LengthReward, VaderScorer
from textgym.rewards.http import HTTPRewardModel, is_url
from textgym.rewards.reasoning_gym_verifier import ReasoningGymVerifier

ENTRY_POINT_GROUP = "textgym.reward_models"

__all__ = ["ENTRY_POINT_GROUP", "make_reward_model", "register", "registered_names"]

_REGISTRY: dict[str, Callable[..., RewardModel]] = {}


def register(name: str, factory: Callable[..., RewardModel] | None = None):
    """Register a reward-model factory under ``name`` (usable as a decorator).

    Args:
        name: what ``reward_model=`` (and ``--reward-model``) will accept.
        factory: returns a reward model (an object with ``score(episodes)``) or a scoring function
            ``f(prompts, responses)``. It is called with the keyword arguments its signature names
            among those the caller offers (the env offers ``device``); ``lambda: KeywordReward("great")``
            takes none, ``def make(device="cpu")`` gets the env's device, ``**kwargs`` gets them all.

    Raises:
        TypeError: ``name`` is not a non-empty str, or ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name={name!r} must be a non-empty str")

    def deco(f: Callable[..., RewardModel]) -> Callable[..., RewardModel]:
        if not callable(f):
            raise TypeError(f"factory={f!r} for {name!r} is not callable; give a function returning a reward model")
        _REGISTRY[name] = f
        return f

    return deco(factory) if factory is not None else deco


def _default(**kwargs: Any) -> RewardModel:
    return HFRewardModel(DEFAULT_RM, **kwargs)


register("default", _default)
# The embedded RM on the response alone: for a chat policy whose prompt is a request ("Write a short movie
# review that begins with ...") and whose response is the whole review, the text the RM was trained on.
register("default-response", lambda **kwargs: _default(include_prompt=False, **kwargs))
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


def _call_factory(name: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> RewardModel:
    """The registered ``factory``'s reward model, called with the ``kwargs`` its signature takes."""
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a callable without a signature (some builtins): give it nothing
        params = []
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        kwargs = {k: v for k, v in kwargs.items() if k in names}
    return _from_object(factory(**kwargs), name)


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
    if is_url(text):
        return HTTPRewardModel(text)
    if is_spec(text):  # before module:attr, which "reasoning-gym:<dataset>" would otherwise look like
        return ReasoningGymVerifier(text, argument)
    if text in _REGISTRY:
        return _call_factory(text, _REGISTRY[text], kwargs)
    eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == text]
    if eps:
        return _from_object(eps[0].load(), text)
    if ":" in text and not Path(text).exists():
        module_name, _, attr = text.partition(":")
        module = import_module_named(module_name, argument, text)
        if not hasattr(module, attr):
            raise ValueError(f"{argument}={text!r}: module {module_name!r} has no attribute {attr!r}")
        return _from_object(getattr(module, attr), text)
    if Path(text).expanduser().exists() or text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return HFRewardModel(text, **kwargs)
    raise ValueError(
        f"{argument}={text!r} is not a registered name ({', '.join(registered_names())}), "
        "an existing folder, a hub id 'org/name', a 'package.module:attr' string, an http(s):// URL or "
        "'reasoning-gym:<dataset>'"
    )
