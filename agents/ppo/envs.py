"""The env a run trains in: its config's env settings (:class:`textgym.envs.settings.EnvSettings`) as a vector env."""

from __future__ import annotations

import torch

from textgym.episodes import make_episode_envs

from .config import PPOConfig

__all__ = ["make_envs"]


def make_envs(cfg: PPOConfig, num_envs: int, device: torch.device, env_overrides: dict | None = None):
    """The episode env of ``cfg`` with ``num_envs`` slots (the learner's, or a rollout worker's share)."""
    return make_episode_envs(cfg.env_id, num_envs, device=device, **{**cfg.env_kwargs(), **(env_overrides or {})})
