"""Stable-Baselines3 on TextRLHF-v0: policies that start as the reference LM, and the KL penalty.

Train with ``ent_coef=0`` and ``learn(..., callback=KLPenaltyCallback())`` for the exact
KL-regularised objective; an entropy bonus ``ent_coef=β`` is not equivalent (see :mod:`.kl`).
"""

from .kl import KLPenaltyCallback, apply_kl_penalty, penalise_rewards
from .policies import LMFeaturesExtractor, LMPolicy, MaskableLMPolicy

__all__ = [
    "KLPenaltyCallback",
    "LMFeaturesExtractor",
    "LMPolicy",
    "MaskableLMPolicy",
    "apply_kl_penalty",
    "penalise_rewards",
]
