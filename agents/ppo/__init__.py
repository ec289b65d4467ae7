"""The TorchRL PPO agent that trains a causal-LM policy on TextRLHF-v0.

The names are imported on first use, so ``textgym --help`` (which reads the config's flags) does
not import TorchRL.
"""

from importlib import import_module

__all__ = ["PPOConfig", "Trainer", "train"]

_WHERE = {"PPOConfig": ".config", "Trainer": ".trainer", "train": ".run"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)
