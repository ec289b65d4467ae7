"""Measure a reward model's score mean/std under π_ref, for ``normalize_reward``."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from textgym.policies import LMPolicy

__all__ = ["calibrate"]


@torch.no_grad()
def calibrate(episodes: int = 512, num_envs: int = 64, seed: int = 0, **env_kwargs) -> tuple[float, float]:
    """Sample ``episodes`` responses of π_ref on the env's prompts; return the RM's raw (mean, std).

    ``env_kwargs`` go to ``gym.make_vec("TextRLHF-v0", ...)`` (model, reward_model, prompts, …);
    normalisation is switched off while measuring.
    """
    envs = gym.make_vec("TextRLHF-v0", num_envs=num_envs, vectorization_mode="vector_entry_point",
                        **{**env_kwargs, "normalize_reward": False})  # fmt: skip
    policy = LMPolicy.for_env(envs.unwrapped.model, envs, generator=torch.Generator().manual_seed(seed))
    obs, _ = envs.reset(seed=seed)
    scores: list[float] = []
    while len(scores) < episodes:
        actions, _ = policy.act(obs)
        obs, _, _, _, info = envs.step(actions.cpu().numpy())
        scores.extend(info["rm_score"][info["_rm_score"]].tolist() if "_rm_score" in info else [])
    envs.close()
    values = np.array(scores[:episodes])
    return float(values.mean()), float(values.std())
