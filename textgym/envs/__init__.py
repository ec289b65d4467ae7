"""Gymnasium environments of textgym.

The env classes load torch and transformers: they are imported on first use (``textgym --help`` and
``import textgym`` need neither), and with them torch's default thread count is applied.
"""

from importlib import import_module

from textgym.envs.checks import DEFAULT_KL_COEF, check_kl_coef
from textgym.envs.prompts import load_prompts

__all__ = [
    "DEFAULT_KL_COEF",
    "TextMultiTurnEnv",
    "TextMultiTurnVectorEnv",
    "TextRLHFEnv",
    "TextRLHFVectorEnv",
    "check_kl_coef",
    "load_prompts",
]

_WHERE = {"TextRLHFEnv": ".text_rlhf", "TextRLHFVectorEnv": ".text_rlhf", "TextMultiTurnEnv": ".multi_turn",
          "TextMultiTurnVectorEnv": ".multi_turn"}  # fmt: skip


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)
