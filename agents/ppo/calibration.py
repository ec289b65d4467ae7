"""Standardise the reward model's score at the run's own length cap and temperature.

A reward model's stored mean/std under π_ref were measured at one length cap and temperature
(``RewardNorm``); π_ref's responses at another cap score differently, so standardising with them
leaves π_ref's score off 0 (the env warns). A run at other settings measures the mean/std itself,
under π_ref sampled as the run samples, before training — as the benchmark does — and pays the
score standardised with those; the saved policy records them, so ``textgym eval`` pays the same.

A measurement is kept twice: per process for the same settings, and on disk (``cache_dir()/calibration``)
under a digest of everything it depends on — π_ref's and the reward model's weights as loaded, the
prompts' text, the env's arguments, the temperature, the thread count, the torch and textgym versions
— so a second run of the same settings (another process, a resumed run, the test suite's CLI runs)
reads the numbers the first one measured instead of sampling 512 episodes again. A changed weight,
prompt or setting is another digest: the cache is never stale, only unused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch

from textgym.named_models import cache_dir
from textgym.rewards.base import stored_norm
from textgym.rewards.builtin import HFRewardModel
from textgym.rewards.calibrate import raw_envs, reference_name, sample_episodes, stored_reference

from .config import PPOConfig

__all__ = ["CALIBRATION_EPISODES", "calibration_digest", "run_norm"]

CALIBRATION_EPISODES = 512  # as `textgym rm-calibrate`: the mean's standard error is 4 % of a std
CALIBRATION_SEED = 0  # fixed, not the run's seed: runs of one config share one scale, and a resume repeats it


def run_norm(cfg: PPOConfig, device: torch.device, env_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"normalize_reward": (mean, std)}`` measured at the run's settings, or {} where no calibration is due.

    Due when the reward is standardised by default (``normalize_reward`` None) and the reward model's
    stored statistics were measured at another ``max_new_tokens`` or temperature than the run's, or under
    another π_ref (the stats file's ``reference_model``, e.g. the embedded LM's for the embedded RM).
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
        # a served model's read from its server within reward_timeout (an error when it cannot be)
        stored = stored_norm(envs.unwrapped.reward_model, kwargs.get("reward_timeout"))
        settings = {"max_new_tokens": kwargs["max_new_tokens"], "temperature": cfg.temperature}
        # the π_ref they were measured under too (not recorded: taken as this one, as before it was kept)
        reference = stored_reference(envs.unwrapped.reward_model)
        same_settings = all(getattr(stored, k, None) in (None, v) for k, v in settings.items())
        if stored is None or (same_settings and reference in (None, reference_name(envs.unwrapped.model))):
            return {}  # raw scores, or stored at these very settings under this very π_ref
        path = _cache_file(envs.unwrapped, kwargs, cfg.temperature, device)
        if (cached := _read_cached(path)) is not None:
            return {"normalize_reward": cached}
        rows = sample_episodes(CALIBRATION_EPISODES, seed=CALIBRATION_SEED, envs=envs, temperature=cfg.temperature)
    finally:
        envs.close()
    scores = np.array([row["rm_score"] for row in rows])
    norm = (float(scores.mean()), float(scores.std()))
    _write_cached(path, norm)
    return {"normalize_reward": norm}


def calibration_digest(base, kwargs: dict[str, Any], temperature: float, device: torch.device) -> str | None:
    """A sha256 of everything π_ref's score distribution depends on; None where that cannot be read off.

    ``base``: the raw-reward env (its models and prompts as loaded). Only a Hugging Face reward
    model (weights, tokenizer, label and pooling settings) can be digested; a Python or HTTP reward
    model could change between processes without a trace, so its measurement is not kept on disk.
    """
    rm = base.reward_model
    if type(rm) is not HFRewardModel:
        return None
    h = hashlib.sha256()
    for model in (base.model, rm.model):
        for name, tensor in model.state_dict().items():
            h.update(name.encode())
            h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    settings = {
        "env": sorted((k, repr(v)) for k, v in kwargs.items()),
        "prompts": hashlib.sha256("\0".join(base.prompts).encode()).hexdigest(),
        "vocab": [len(base.tokenizer), len(rm.tokenizer)],
        "rm": [rm.label, rm.use_logprob, rm.include_prompt, rm.batch_size, rm.shares_tokenizer],
        "sampling": [temperature, CALIBRATION_EPISODES, CALIBRATION_SEED, str(device), torch.get_num_threads()],
        "versions": [torch.__version__, version("textgym")],
    }
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def _cache_file(base, kwargs: dict[str, Any], temperature: float, device: torch.device) -> Path | None:
    digest = calibration_digest(base, kwargs, temperature, device)
    return None if digest is None else cache_dir() / "calibration" / f"{digest}.json"


def _read_cached(path: Path | None) -> tuple[float, float] | None:
    """The (mean, std) kept in ``path``; None when there is none or it is not two finite numbers, std > 0."""
    if path is None or not path.is_file():
        return None
    try:
        mean, std = json.loads(path.read_text(encoding="utf-8"))["normalize_reward"]
    except (OSError, ValueError, KeyError, TypeError):  # torn or foreign: measured again and replaced
        return None
    ok = all(isinstance(v, float) and math.isfinite(v) for v in (mean, std)) and std > 0
    return (mean, std) if ok else None


def _write_cached(path: Path | None, norm: tuple[float, float]) -> None:
    """Keep ``norm`` in ``path`` through a temp file of its own and a rename: concurrent runs never tear it.

    A cache that cannot be written (read-only, full) is skipped: the run goes on with its own measurement.
    """
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"normalize_reward": list(norm)}, f)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
