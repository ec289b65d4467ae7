"""Gymnasium environments of textgym."""

from textgym.envs.text_rlhf import TextRLHFEnv, TextRLHFVectorEnv, load_prompts

__all__ = ["TextRLHFEnv", "TextRLHFVectorEnv", "load_prompts"]
