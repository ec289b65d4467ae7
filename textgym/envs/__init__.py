"""Gymnasium environments of textgym."""

from textgym.envs.text_rlhf import DEFAULT_KL_COEF, TextRLHFEnv, TextRLHFVectorEnv, check_kl_coef, load_prompts

__all__ = ["DEFAULT_KL_COEF", "TextRLHFEnv", "TextRLHFVectorEnv", "check_kl_coef", "load_prompts"]
