"""Where a rollout's episodes come from, chosen once: this process, Ray workers, or Ray workers one step ahead.

Each source has ``collect(policy, sampler, beta, num_episodes, seed, draw, timing)`` (the complete
episodes of one rollout, ``collect_episodes``' layout: the learner's ``sampler`` acts in this process,
Ray workers load ``policy``'s weights into their own), ``state()``/``load_state(...)`` (what a checkpoint
keeps of it) and ``close()``. ``draw(num_episodes, seed)`` is the estimator's choice of starts
(:meth:`.algorithms.GroupBaseline.starts`): ``(collect_episodes' prompts / partner_seeds or None, the seed left
for the rollout)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from textgym.episodes import collect_episodes
from textgym.policies import LMSampler

from .config import PPOConfig

__all__ = ["LocalRollouts", "make_rollouts"]

Draw = Callable[[int, "int | None"], "tuple[list[str] | None, int | None]"]


class LocalRollouts:
    """The learner's own env and sampler (``num_workers=0``)."""

    def __init__(self, envs, autocast: Callable):
        self.envs, self.autocast = envs, autocast

    def collect(self, policy: torch.nn.Module, sampler: LMSampler, beta: float, num_episodes: int | None,
                seed: int | None, draw: Draw, timing: dict[str, float]):  # fmt: skip
        """``num_episodes`` (default: one per slot) complete episodes sampled by ``sampler`` (over ``policy``)."""
        starts, seed = draw(num_episodes or self.envs.num_envs, seed)
        return collect_episodes(self.envs, sampler, num_episodes=num_episodes, seed=seed, autocast=self.autocast,
                                timing=timing, **(starts or {}))  # fmt: skip

    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Nothing beyond the learner's env and sampler, which the trainer saves itself."""
        return {}, {}

    def load_state(self, ckpt: Path, state: dict[str, Any], tensors: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None


def make_rollouts(cfg: PPOConfig, envs, autocast: Callable, env_overrides: dict[str, Any], device: torch.device,
                  bf16: bool):  # fmt: skip
    """The rollout source of ``cfg``: in this process, or on ``num_workers`` Ray workers (``async_rollout``: ahead)."""
    if not cfg.num_workers:
        return LocalRollouts(envs, autocast)
    from .ray_rollout import AsyncRayRollouts, RayRollouts, RolloutPool

    pool = RolloutPool(cfg, env_overrides, device, bf16=bf16)
    return (AsyncRayRollouts if cfg.async_rollout else RayRollouts)(pool, cfg)
