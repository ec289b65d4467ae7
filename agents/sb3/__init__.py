"""Stable-Baselines3 on TextRLHF-v0: policies that start as the reference LM."""

from .policies import LMFeaturesExtractor, LMPolicy, MaskableLMPolicy

__all__ = ["LMFeaturesExtractor", "LMPolicy", "MaskableLMPolicy"]
