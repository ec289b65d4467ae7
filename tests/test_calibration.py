"""The per-run RM calibration: measured at the run's settings, kept on disk under a digest of its inputs."""

import json

import pytest
import torch

from textgym.agents.ppo import PPOConfig, calibration
from textgym.agents.ppo.config import PRESETS
from textgym.rewards.calibrate import raw_envs


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty disk cache, no per-process memo, and a short calibration (the digest includes its size)."""
    monkeypatch.setenv("TEXTGYM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(calibration, "_MEASURED", {})
    monkeypatch.setattr(calibration, "CALIBRATION_EPISODES", 16)
    return tmp_path / "cache" / "calibration"


def tiny(**changes) -> PPOConfig:
    return PPOConfig(**{**PRESETS["tiny"], **changes})


def test_a_second_process_reads_the_measurement_instead_of_sampling_again(fresh_cache, monkeypatch):
    device = torch.device("cpu")
    first = calibration.run_norm(tiny(), device)["normalize_reward"]  # tiny: 6 tokens, the RM stored at 32
    [kept] = list(fresh_cache.glob("*.json"))
    assert json.loads(kept.read_text()) == {"normalize_reward": list(first)} and first[1] > 0

    monkeypatch.setattr(calibration, "_MEASURED", {})  # as a new process: only the disk remains
    monkeypatch.setattr(calibration, "sample_episodes", lambda *a, **kw: pytest.fail("sampled again"))
    assert calibration.run_norm(tiny(), device)["normalize_reward"] == first  # to the bit


def test_other_settings_are_measured_apart(fresh_cache):
    device = torch.device("cpu")
    a = calibration.run_norm(tiny(), device)["normalize_reward"]
    b = calibration.run_norm(tiny(temperature=0.7), device)["normalize_reward"]
    assert len(list(fresh_cache.glob("*.json"))) == 2 and a != b


def test_a_torn_cache_file_is_measured_again_and_replaced(fresh_cache, monkeypatch):
    device = torch.device("cpu")
    first = calibration.run_norm(tiny(), device)["normalize_reward"]
    [kept] = list(fresh_cache.glob("*.json"))
    kept.write_text('{"normalize_reward": [0.1')
    monkeypatch.setattr(calibration, "_MEASURED", {})
    assert calibration.run_norm(tiny(), device)["normalize_reward"] == first
    assert json.loads(kept.read_text()) == {"normalize_reward": list(first)}
    assert not list(fresh_cache.glob("*.tmp"))


def test_the_digest_follows_the_weights_and_only_digests_hf_reward_models(fresh_cache):
    device, kwargs = torch.device("cpu"), {"max_new_tokens": 6}
    envs = raw_envs(2, max_new_tokens=6)
    try:
        base = envs.unwrapped
        before = calibration.calibration_digest(base, kwargs, 1.0, device)
        assert before == calibration.calibration_digest(base, kwargs, 1.0, device)
        with torch.no_grad():
            next(base.model.parameters()).view(-1)[0] += 1e-3  # one weight of π_ref
        assert calibration.calibration_digest(base, kwargs, 1.0, device) != before
        assert calibration.calibration_digest(base, {"max_new_tokens": 7}, 1.0, device) != before
    finally:
        envs.close()
    envs = raw_envs(2, max_new_tokens=6, reward_model=lambda prompts, responses: [0.0] * len(responses))
    try:  # a Python reward model may change between processes without a trace: never kept on disk
        assert calibration.calibration_digest(envs.unwrapped, kwargs, 1.0, device) is None
    finally:
        envs.close()


def test_another_pi_ref_than_the_stored_statistics_were_measured_under_is_measured(fresh_cache, tmp_path):
    """Issue 37.9: at the RM's stored settings (32 tokens, temperature 1) another π_ref used its mean/std silently.

    The embedded RM's statistics name the embedded LM; a copy of it elsewhere stands for another π_ref
    (a model is known by where it comes from: measuring once more is the safe side).
    """
    import shutil

    from textgym.models import DEFAULT_LM

    device = torch.device("cpu")
    assert calibration.run_norm(tiny(max_new_tokens=32), device) == {}  # the embedded π_ref: stored stats apply
    other = shutil.copytree(DEFAULT_LM, tmp_path / "other-lm")
    measured = calibration.run_norm(tiny(max_new_tokens=32, model=str(other)), device)
    assert measured["normalize_reward"][1] > 0
