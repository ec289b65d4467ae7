"""Gymnasium environments of textgym."""

from textgym.envs.checks import check_kl_coef
from textgym.envs.engine import DEFAULT_KL_COEF
from textgym.envs.multi_turn import TextMultiTurnEnv, TextMultiTurnVectorEnv
from textgym.envs.prompts import load_prompts
from textgym.envs.text_rlhf import TextRLHFEnv, TextRLHFVectorEnv

__all__ = [
    "DEFAULT_KL_COEF",
    "TextMultiTurnEnv",
    "TextMultiTurnVectorEnv",
    "TextRLHFEnv",
    "TextRLHFVectorEnv",
    "check_kl_coef",
    "load_prompts",
]
