"""The TorchRL PPO agent that trains a causal-LM policy on TextRLHF-v0."""

from .config import PPOConfig
from .evaluate import evaluate
from .train import Trainer, train

__all__ = ["PPOConfig", "Trainer", "evaluate", "train"]
