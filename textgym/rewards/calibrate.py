"""Sample π_ref through the env and measure a reward model's score distribution under it."""

from __future__ import annotations

import numpy as np
import torch

from textgym.episodes import collect_episodes, make_episode_envs
from textgym.policies import LMSampler
from textgym.rewards.base import REFERENCE_KEY, reference_name, stored_reference

__all__ = ["REFERENCE_KEY", "calibrate", "raw_envs", "reference_name", "sample_episodes", "stored_reference"]


def raw_envs(num_envs: int = 64, env_id: str = "TextRLHF-v0", **env_kwargs):
    """The native vector env of ``env_kwargs`` paying the raw RM score (what calibration samples in)."""
    return make_episode_envs(env_id, num_envs, **{**env_kwargs, "normalize_reward": False})


@torch.no_grad()
def sample_episodes(episodes: int = 512, num_envs: int = 64, seed: int = 0, env_id: str = "TextRLHF-v0", *,
                    envs=None, temperature: float = 1.0, **env_kwargs) -> list[dict]:  # fmt: skip
    """Finished episodes of π_ref (the env's model) sampled at ``temperature`` on the env's prompts.

    ``envs``: a raw-reward vector env to sample in (:func:`raw_envs`; left open), else one is built
    from ``env_id`` and ``env_kwargs`` and closed. Each row has ``prompt``, ``response``,
    ``rm_score``, ``gold_score`` and ``turn_reward_sum`` (a partner's rewards; 0 in a single-turn env).
    """
    own = envs is None
    envs = raw_envs(num_envs, env_id, **env_kwargs) if own else envs
    num_envs = envs.num_envs
    generator = torch.Generator(device=envs.unwrapped.model.device).manual_seed(seed)
    policy = LMSampler.for_env(envs.unwrapped.model, envs, temperature=temperature, generator=generator)
    rows: list[dict] = []
    while len(rows) < episodes:
        first = not rows
        done = collect_episodes(envs, policy, num_episodes=min(num_envs, episodes - len(rows)),
                                seed=seed if first else None)  # fmt: skip
        rows.extend({k: done[k][i] if k in ("prompt", "response") else float(done[k][i])
                     for k in ("prompt", "response", "rm_score", "gold_score", "turn_reward_sum")}
                    for i in range(done.batch_size[0]))  # fmt: skip
    if own:
        envs.close()
    return rows


def calibrate(episodes: int = 512, num_envs: int = 64, seed: int = 0, **env_kwargs) -> tuple[float, float]:
    """The reward model's raw score (mean, std) over ``episodes`` samples of π_ref."""
    scores = np.array([row["rm_score"] for row in sample_episodes(episodes, num_envs, seed, **env_kwargs)])
    return float(scores.mean()), float(scores.std())
