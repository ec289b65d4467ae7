"""Sample π_ref through the env and measure a reward model's score distribution under it."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from textgym.episodes import collect_episodes
from textgym.policies import LMSampler

__all__ = ["calibrate", "sample_episodes"]


@torch.no_grad()
def sample_episodes(episodes: int = 512, num_envs: int = 64, seed: int = 0, env_id: str = "TextRLHF-v0",
                    **env_kwargs) -> list[dict]:  # fmt: skip
    """Finished episodes of π_ref sampled at temperature 1 (the env's model) on the env's prompts.

    ``env_kwargs`` go to ``gym.make_vec(env_id, ...)``; the reward is left raw.
    Each row has ``prompt``, ``response``, ``rm_score`` and ``gold_score``.
    """
    envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point",
                        autoreset_mode="disabled", **{**env_kwargs, "normalize_reward": False})  # fmt: skip
    policy = LMSampler.for_env(envs.unwrapped.model, envs, generator=torch.Generator().manual_seed(seed))
    rows: list[dict] = []
    while len(rows) < episodes:
        first = not rows
        done = collect_episodes(envs, policy, num_episodes=min(num_envs, episodes - len(rows)),
                                seed=seed if first else None)  # fmt: skip
        rows.extend({k: done[k][i] if k in ("prompt", "response") else float(done[k][i])
                     for k in ("prompt", "response", "rm_score", "gold_score")}
                    for i in range(done.batch_size[0]))  # fmt: skip
    envs.close()
    return rows


def calibrate(episodes: int = 512, num_envs: int = 64, seed: int = 0, **env_kwargs) -> tuple[float, float]:
    """The reward model's raw score (mean, std) over ``episodes`` samples of π_ref."""
    scores = np.array([row["rm_score"] for row in sample_episodes(episodes, num_envs, seed, **env_kwargs)])
    return float(scores.mean()), float(scores.std())
