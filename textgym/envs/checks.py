"""Checks of TextRLHF-v0's constructor arguments, shared by the engine and the env classes.

Each returns the value as the engine keeps it, or raises one error naming the argument, the value
and what is allowed (the checks of ``reset`` and ``step`` arguments are beside those methods).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from textgym.errors import short_repr

if TYPE_CHECKING:
    from textgym.rewards.base import RewardNorm

DEFAULT_KL_COEF = 0.05  # β: the one default of the env, the PPO agent, the CLI and the benchmark

__all__ = [
    "DEFAULT_KL_COEF",
    "check_chat_template",
    "check_int",
    "check_kl_coef",
    "check_nonnegative",
    "check_positions",
    "check_timeout",
    "check_vocabulary",
    "resolve_norm",
    "resolve_stop_ids",
]


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or one ValueError naming it (bools are refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    return int(value)


def check_nonnegative(name: str, value: Any) -> float:
    """``value`` as a finite float >= 0, or one ValueError naming it (bools and strings are refused)."""
    real = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not real or not np.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be a finite float >= 0")
    return float(value)


def check_kl_coef(value: Any, name: str = "kl_coef") -> float:
    """β as a finite float >= 0, or one ValueError naming it: the one check every entry point uses."""
    return check_nonnegative(name, value)


def check_vocabulary(model: Any, vocab_size: int, tokenizer) -> None:
    """Refuse a model with fewer output tokens than its tokenizer has ids: a prompt (or an EOS/PAD id) past
    the model's rows would fail later inside a forward with an IndexError. More rows than ids (a head
    padded to a multiple of 64) are fine: the env only reads the first ``vocab_size`` logits.
    """
    ids = len(tokenizer)
    if vocab_size < ids:
        raise ValueError(
            f"model={short_repr(str(model) if model is not None else 'the embedded LM')} has {vocab_size} output "
            f"tokens but its tokenizer has {ids} ids: token ids >= {vocab_size} have no row in the model; give the "
            "tokenizer the model was trained with (tokenizer=...), or resize the model's embeddings"
        )


def check_timeout(value: Any, name: str = "reward_timeout") -> float | None:
    """``name`` (``reward_timeout``, ``partner_timeout``) as seconds > 0, or None (no limit)."""
    if value is None:
        return None
    real = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not real or not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite float > 0 (seconds) or None (no limit)")
    return float(value)


def check_positions(name: str, model, needed: int, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse episodes longer than the model's positions: it would run past what it was trained on."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and needed > limit:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} with max_prompt_tokens={max_prompt_tokens} needs {needed} positions "
            f"of {name}, more than its max_position_embeddings={limit}; allowed: max_new_tokens <= "
            f"{limit - (needed - max_new_tokens)} (or fewer max_prompt_tokens)"
        )


def resolve_stop_ids(model, tokenizer, stop_token_ids: Sequence[int] | None, vocab_size: int) -> frozenset[int]:
    """The token ids that end an episode.

    Default: the tokenizer's EOS plus every id of the model's ``generation_config.eos_token_id``
    (an int or a list: a chat model's end-of-turn is not the tokenizer's EOS). Given ids are
    used as they are, each checked to be a token id.
    """
    if stop_token_ids is None:
        ids = {int(tokenizer.eos_token_id)}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids |= {int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])}
        return frozenset(i for i in ids if 0 <= i < vocab_size)
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (list, tuple, np.ndarray)):
        raise TypeError(f"stop_token_ids={stop_token_ids!r} must be a list of token ids or None (EOS + the model's)")
    ids = list(stop_token_ids)
    bad = [i for i in ids if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer))
           or not 0 <= i < vocab_size]  # fmt: skip
    if not ids or bad:
        raise ValueError(
            f"stop_token_ids={stop_token_ids!r} must be a non-empty list of token ids in [0, {vocab_size})"
        )
    return frozenset(int(i) for i in ids)


def check_chat_template(chat_template: Any, tokenizer) -> bool:
    if not isinstance(chat_template, (bool, np.bool_)):
        raise TypeError(f"chat_template={chat_template!r} must be a bool")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"chat_template=True but tokenizer {tokenizer.name_or_path!r} has no chat template; "
            "give a chat model's tokenizer or chat_template=False (plain prompts)"
        )
    return bool(chat_template)


def resolve_norm(normalize_reward: Any, reward_model, max_new_tokens: int,
                 timeout: float | None = None) -> RewardNorm | None:  # fmt: skip
    """The (mean, std) the RM score is standardised with, or None; warns when measured at another length cap.

    The stored statistics are read only when ``normalize_reward`` asks for them (None or True): a served
    model reads them from its server within ``timeout`` (``reward_timeout``) and raises
    :class:`~textgym.rewards.RewardModelError` when it cannot, rather than letting the env pay raw scores.
    """
    from textgym.rewards.base import RewardNorm, stored_norm  # the reward models' code (torch): once an env is built

    if isinstance(normalize_reward, (tuple, list)):
        pair = normalize_reward
        ok = len(pair) == 2 and all(isinstance(v, (int, float)) and np.isfinite(v) for v in pair)
        if not ok or not normalize_reward[1] > 0:
            raise ValueError(f"normalize_reward={normalize_reward!r} must be a bool, None or a (mean, std > 0) pair")
        return RewardNorm(float(normalize_reward[0]), float(normalize_reward[1]), max_new_tokens)
    if normalize_reward is not None and not isinstance(normalize_reward, (bool, np.bool_)):
        raise ValueError(f"normalize_reward={normalize_reward!r} must be a bool, None or a (mean, std > 0) pair")
    if normalize_reward is False:  # raw scores: nothing to read (a served model's server is not asked)
        return None
    stored = stored_norm(reward_model, timeout)
    if normalize_reward and stored is None:
        raise ValueError(
            f"normalize_reward=True but reward model {reward_model.name!r} has no stored mean/std; "
            "run `textgym rm-calibrate` on it, pass (mean, std) or normalize_reward=False"
        )
    if stored is None:
        return None
    if stored.max_new_tokens not in (None, max_new_tokens):
        warnings.warn(
            f"reward model {reward_model.name!r}: its stored mean/std were measured under π_ref at "
            f"max_new_tokens={stored.max_new_tokens} (temperature {stored.temperature}), this env runs "
            f"max_new_tokens={max_new_tokens}, so π_ref's normalised score is not 0 here; run `textgym "
            f"rm-calibrate --max-new-tokens {max_new_tokens}` on it, or pass normalize_reward=(mean, std) or False "
            "(the env cannot see the agent's sampling temperature: calibrate at the one you sample at)",
            stacklevel=4,
        )
    return stored


def check_norm_reference(normalize_reward: Any, norm: RewardNorm | None, reward_model, model) -> None:
    """Refuse standardising by default with a mean/std that were measured under another π_ref.

    Why: a reward model's stored statistics describe its scores on one π_ref's responses (the embedded RM's: the
    embedded LM's). Under another π_ref (SmolLM2) the scores have another mean and spread, so "normalised"
    scores were silently off by both and β's weight against them with it. ``textgym train`` measures them
    itself at the run's settings; an env built by hand says what to pass.
    """
    from textgym.rewards.base import reference_name, stored_reference

    measured = stored_reference(reward_model) if normalize_reward is None and norm is not None else None
    if measured is None or measured == reference_name(model):
        return
    raise ValueError(
        f"normalize_reward=None would standardise reward model {getattr(reward_model, 'name', reward_model)!r}'s "
        f"scores with the mean/std stored beside it, measured under π_ref {measured!r}; this env's π_ref is "
        f"{reference_name(model)!r}, whose responses score otherwise. Pass normalize_reward=False (raw scores) or "
        "normalize_reward=(mean, std) measured under this π_ref (textgym.rewards.calibrate.calibrate(model=..., "
        "reward_model=...) returns them); `textgym train` measures them itself"
    )
