"""textgym: RLHF with PPO as a Gymnasium environment, and the agents that train on it.

Importing the package registers ``TextRLHF-v0``::

    import gymnasium as gym
    import textgym

    env = gym.make("TextRLHF-v0")
    envs = gym.make_vec("TextRLHF-v0", num_envs=8, vectorization_mode="vector_entry_point")
"""

from gymnasium.envs.registration import register

from textgym.envs import TextRLHFEnv, TextRLHFVectorEnv  # noqa: E402  (imports torch + transformers once)

__version__ = "0.1.0"

register(
    id="TextRLHF-v0",
    entry_point="textgym.envs.text_rlhf:TextRLHFEnv",
    vector_entry_point="textgym.envs.text_rlhf:TextRLHFVectorEnv",
    disable_env_checker=False,
)

__all__ = ["TextRLHFEnv", "TextRLHFVectorEnv", "__version__"]
