"""Reward models: the protocol, the built-ins and the registry that resolves ``reward_model=``."""

from textgym.rewards.base import Episodes, RewardModel, RewardModelError, load_norm, save_norm, score_checked
from textgym.rewards.builtin import CallableRewardModel, HFRewardModel, VaderScorer
from textgym.rewards.registry import ENTRY_POINT_GROUP, make_reward_model, register, registered_names

__all__ = [
    "CallableRewardModel",
    "ENTRY_POINT_GROUP",
    "Episodes",
    "HFRewardModel",
    "RewardModel",
    "RewardModelError",
    "VaderScorer",
    "load_norm",
    "make_reward_model",
    "register",
    "registered_names",
    "save_norm",
    "score_checked",
]
