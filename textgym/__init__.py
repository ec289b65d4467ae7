"""textgym: RLHF with PPO as a Gymnasium environment, and the agents that train on it.

Importing the package registers ``TextRLHF-v0`` (and ``TextArithmetic-v0``) and chooses torch's CPU threads:
imported before torch, OpenMP's passive wait and every core; after torch, one core fewer (unless
``OMP_NUM_THREADS`` is set; :mod:`textgym.threads` says why)::

    import gymnasium as gym
    import textgym

    env = gym.make("TextRLHF-v0")
    envs = gym.make_vec("TextRLHF-v0", num_envs=8, vectorization_mode="vector_entry_point")
"""

from textgym.allocator import fix_mmap_threshold
from textgym.threads import apply_default_threads, set_wait_policy

fix_mmap_threshold()  # freed tensors return to the OS instead of fragmenting malloc's heaps (allocator.py says why)
set_wait_policy()  # before torch loads: OpenMP's passive wait, so every core is the default (threads.py says why)

import sys  # noqa: E402
from importlib import import_module  # noqa: E402

from gymnasium.envs.registration import register  # noqa: E402

from textgym.asset_paths import ARITH_LM, ARITH_TRAIN  # noqa: E402

if "torch" in sys.modules:  # loaded first: one core fewer now (threads.py); else when the env classes load torch
    apply_default_threads()

__version__ = "0.1.0"

register(
    id="TextRLHF-v0",
    entry_point="textgym.envs.text_rlhf:TextRLHFEnv",
    vector_entry_point="textgym.envs.text_rlhf:TextRLHFVectorEnv",
    disable_env_checker=False,
)

# The same env on a verifiable task: "a+b=" problems, reward 1 for the exact sum (RLVR), a tiny π_ref
# that starts at 37 % exact answers at temperature 1 (textgym/assets/arith_lm/build_report.json).
# reward_model="arithmetic-proxy" pays a learned, imperfect proxy of the verifier instead, gold_score staying the
# verifier's: over-optimisation measured against an exact gold (textgym/assets/arith_proxy_rm/build_report.json).
register(
    id="TextArithmetic-v0",
    entry_point="textgym.envs.text_rlhf:TextRLHFEnv",
    vector_entry_point="textgym.envs.text_rlhf:TextRLHFVectorEnv",
    disable_env_checker=False,
    kwargs={
        "model": str(ARITH_LM),
        "reward_model": "arithmetic",
        "gold_scorer": "arithmetic",
        "prompts": str(ARITH_TRAIN),
        "max_new_tokens": 4,
        "normalize_reward": False,
    },  # fmt: skip
)

# Conversations on the same engine: the policy speaks, a partner (a game, a tool, a user simulator) answers.
register(
    id="TextMultiTurn-v0",
    entry_point="textgym.envs.multi_turn:TextMultiTurnEnv",
    vector_entry_point="textgym.envs.multi_turn:TextMultiTurnVectorEnv",
    disable_env_checker=False,
)

__all__ = ["TextMultiTurnEnv", "TextMultiTurnVectorEnv", "TextRLHFEnv", "TextRLHFVectorEnv", "__version__"]


def __getattr__(name: str):
    """The env classes on first use: they import torch and transformers, which ``textgym --help`` never needs."""
    if name in ("TextMultiTurnEnv", "TextMultiTurnVectorEnv", "TextRLHFEnv", "TextRLHFVectorEnv"):
        return getattr(import_module("textgym.envs"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
