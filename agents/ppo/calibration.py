"""Standardise the reward model's score at the run's own length cap and temperature.

A reward model's stored mean/std under π_ref were measured at one length cap and temperature
(``RewardNorm``); π_ref's responses at another cap score differently, so standardising with them
leaves π_ref's score off 0 (the env warns). A run at other settings measures the mean/std itself,
under π_ref sampled as the run samples, before training — as the benchmark does — and pays the
score standardised with those; the saved policy records them, so ``textgym eval`` pays the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from textgym.rewards.calibrate import raw_envs, sample_episodes

from .config import PPOConfig

__all__ = ["CALIBRATION_EPISODES", "run_norm"]

CALIBRATION_EPISODES = 512  # as `textgym rm-calibrate`: the mean's standard error is 4 % of a std
CALIBRATION_SEED = 0  # fixed, not the run's seed: runs of one config share one scale, and a resume repeats it


def run_norm(cfg: PPOConfig, device: torch.device, env_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"normalize_reward": (mean, std)}`` measured at the run's settings, or {} where no calibration is due.

    Due when the reward is standardised by default (``normalize_reward`` None) and the reward model's
    stored statistics were measured at another ``max_new_tokens`` or temperature than the run's.
    ``env_overrides`` (the benchmark's env arguments) apply over the config's, as in the trainer.
    """
    kwargs = {**cfg.env_kwargs(), **(env_overrides or {})}
    if kwargs.get("normalize_reward") is not None:  # chosen: raw, stored, or a (mean, std) pair
        return {}
    # one measurement per process for the same settings (and thread count, which its rounding depends on):
    # a process that builds several trainers of one config (the benchmark's seeds, a test suite) pays once
    key = repr((cfg.env_id, sorted(kwargs.items(), key=lambda kv: kv[0]), cfg.temperature, str(device),
                torch.get_num_threads()))  # fmt: skip
    if key not in _MEASURED:
        _MEASURED[key] = _measure(cfg, device, kwargs)
    return dict(_MEASURED[key])


_MEASURED: dict[str, dict[str, Any]] = {}


def _measure(cfg: PPOConfig, device: torch.device, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Sample ``CALIBRATION_EPISODES`` π_ref episodes at the run's settings: {} where none are due."""
    envs = raw_envs(min(64, CALIBRATION_EPISODES), cfg.env_id, device=device, **kwargs)
    try:
        stored = getattr(envs.unwrapped.reward_model, "norm", None)
        settings = {"max_new_tokens": kwargs["max_new_tokens"], "temperature": cfg.temperature}
        if stored is None or all(getattr(stored, k, None) in (None, v) for k, v in settings.items()):
            return {}  # raw scores, or stored at these very settings
        rows = sample_episodes(CALIBRATION_EPISODES, seed=CALIBRATION_SEED, envs=envs, temperature=cfg.temperature)
    finally:
        envs.close()
    scores = np.array([row["rm_score"] for row in rows])
    return {"normalize_reward": (float(scores.mean()), float(scores.std()))}
