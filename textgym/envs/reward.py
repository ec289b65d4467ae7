"""The env's reward: the reward models, the missing-EOS penalty, β, and the one formula.

A step pays, per slot,

    r_t = β·log π_ref(a_t|s_t) + turn reward + (score − penalty) + β·Σ_t log π_ref(a_t|s_t)

where the first term is paid at each step when π_ref scores step by step and the last, once, at the
episode's end when it scores the finished episode (``reference_scoring="episode"``); the turn reward is
a partner's, on the turn's last token; the score (the reward model's, standardised under π_ref when
``normalize_reward``) minus ``missing_eos_penalty`` (when the length cap cut the response) is paid on
the last step. :func:`reward` is that sum; :meth:`Rewards.token_infos` writes it token by token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from textgym.envs.checks import check_kl_coef, check_norm_reference, check_positions, resolve_norm
from textgym.rewards import Episodes, make_reward_model, score_checked, verdicts_checked

__all__ = ["Rewards", "load_scorers", "reward"]


def reward(kl: Any, turn: Any, end: Any, late_kl: Any = 0.0) -> Any:
    """The reward formula (module docstring), on floats or arrays: ``kl`` the step's β·log π_ref, ``turn`` a
    partner's turn reward, ``end`` the score minus the penalty, ``late_kl`` β·Σ log π_ref of an episode scored
    at its end. Summed in this order, so a step and its token-by-token infos agree to the last bit."""
    return kl + turn + end + late_kl


@dataclasses.dataclass
class Rewards:
    """The scorers of an env and the constants of its reward."""

    reward_model: Any  # None: a conversation whose rewards are all its partner's
    gold_scorer: Any  # None: the dialogue's own score (a game's outcome), or NaN
    norm: tuple | None  # (mean, std, ...) of the reward model's score under π_ref, or None
    missing_eos_penalty: float
    timeout: float | None
    _kl_coef: float = 0.0

    @property
    def kl_coef(self) -> float:
        """β: how much each policy token pays per nat of log π_ref."""
        return self._kl_coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self._kl_coef = check_kl_coef(value)

    def scores(self, episodes: Episodes, slots: list[int] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(raw RM scores, scores as paid, gold scores or None)`` of finished episodes, one batched call per
        scorer; ``slots`` name the episodes in errors."""
        if self.reward_model is not None:
            rm = score_checked(self.reward_model, episodes, slots=slots, timeout=self.timeout)
        else:  # a conversation whose rewards are all its partner's
            rm = np.zeros(len(episodes.prompts))
        gold = None
        if self.gold_scorer is not None:
            gold = score_checked(self.gold_scorer, episodes, slots=slots, timeout=self.timeout)
        score = (rm - self.norm[0]) / self.norm[1] if self.norm is not None else rm
        return rm, score, gold

    def verdicts(self, episodes: Episodes) -> np.ndarray | None:
        """``(B,)`` float64 1.0/0.0: the reward model's verdict on each finished episode, or None when it gives
        none (a learned RM scores, it does not judge)."""
        return None if self.reward_model is None else verdicts_checked(self.reward_model, episodes)

    def penalty(self, capped: bool) -> float:
        """What an episode loses when the length cap, not a stop token, ended it."""
        return self.missing_eos_penalty if capped else 0.0

    def token_infos(self, ref_lp: np.ndarray, turn_rewards: np.ndarray, end: float, new_tokens: int) -> dict:
        """The per-token infos of an episode scored at its end: what stepping it would have paid, token by token.

        ``token_ref_logprobs`` (T,) is log π_ref(a_t|s_t) (``ref_lp``: 0 on a partner's tokens), ``token_rewards``
        (T,) the formula per token: β·log π_ref(a_t|s_t), a turn's reward on its last token, and on the last token
        the score minus the missing-EOS penalty; both 0 past the response. The ``token_`` prefix names an
        episode's per-token arrays; a step's own scalar is ``ref_logprob``. ``ref_logprobs`` is the deprecated
        name of ``token_ref_logprobs`` (issue 43), still written for one version.
        """
        length = len(ref_lp)
        ref_logprobs = np.zeros(new_tokens, dtype=np.float64)
        ref_logprobs[:length] = ref_lp
        ends = np.zeros(new_tokens, dtype=np.float64)
        ends[length - 1] = end
        rewards = reward(self.kl_coef * ref_logprobs, turn_rewards, ends)
        return {"token_ref_logprobs": ref_logprobs, "token_rewards": rewards, "ref_logprobs": ref_logprobs.copy()}


def load_scorers(reward_model, gold_scorer, normalize_reward, *, optional: bool, device, tokenizer, reference,
                 shape: tuple[int, int], timeout: float | None, missing_eos_penalty: float) -> Rewards:  # fmt: skip
    """The reward model, the gold scorer and the reward normalisation, checked against the env.

    Loaded once the observation's width is known (``shape`` = (P, T)): a reward model sharing the tokenizer
    must have positions for a whole episode, and its stored normalisation is checked against ``T``.
    ``optional``: a conversation's rewards may all be its partner's, so no reward model is loaded unless given.
    """
    P, T = shape

    def bound(rm):
        if hasattr(rm, "bind"):
            rm.bind(tokenizer)
        return rm

    rm = None if reward_model is None and optional else bound(make_reward_model(reward_model, "reward_model",
                                                                                device=device))  # fmt: skip
    if getattr(rm, "shares_tokenizer", False) and hasattr(rm, "model"):
        # it scores prompt + response + the EOS closing a length-capped response
        check_positions("reward_model", rm.model, P + T + 1, P, T)
    gold = None if gold_scorer is None else bound(make_reward_model(gold_scorer, "gold_scorer"))
    norm = resolve_norm(normalize_reward, rm, T, timeout=timeout)
    check_norm_reference(normalize_reward, norm, rm, reference)
    return Rewards(rm, gold, norm, missing_eos_penalty, timeout)
