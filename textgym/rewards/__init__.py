"""Reward models: the protocol, the built-ins and the registry that resolves ``reward_model=``."""

from textgym.rewards.base import (
    Episodes,
    RewardModel,
    RewardModelError,
    RewardNorm,
    load_norm,
    save_norm,
    score_checked,
    verdicts_checked,
)
from textgym.rewards.builtin import (
    CallableRewardModel,
    HFRewardModel,
    KeywordReward,
    LengthReward,
    VaderScorer,
)
from textgym.rewards.http import HTTPRewardModel
from textgym.rewards.registry import ENTRY_POINT_GROUP, make_reward_model, register, registered_names
from textgym.rewards.verifiers import AdditionAnswerVerifier, ArithmeticVerifier  # registers both names
from textgym.rewards.weighted import WeightedSumReward

__all__ = [
    "AdditionAnswerVerifier",
    "ArithmeticVerifier",
    "CallableRewardModel",
    "ENTRY_POINT_GROUP",
    "Episodes",
    "HFRewardModel",
    "HTTPRewardModel",
    "KeywordReward",
    "LengthReward",
    "RewardModel",
    "RewardModelError",
    "RewardNorm",
    "VaderScorer",
    "WeightedSumReward",
    "load_norm",
    "make_reward_model",
    "register",
    "registered_names",
    "save_norm",
    "score_checked",
    "verdicts_checked",
]
