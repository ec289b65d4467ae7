"""The evaluator's objective is the env's: score − missing-EOS penalty − β·KL (issue 37.8)."""

from __future__ import annotations

import pytest

from textgym.agents.evaluate import evaluate


def test_objective_subtracts_the_missing_eos_penalty_the_env_pays():
    """Responses cut at 2 tokens pay the env's penalty; the objective reported must pay it too."""
    result = evaluate(episodes=4, num_envs=4, max_new_tokens=2, missing_eos_penalty=100.0, kl_coef=0.1,
                      normalize_reward=False)  # fmt: skip
    assert result["objective"][0] < result["score"][0] - 50.0  # most responses are capped at 2 tokens
    assert result["eos_penalty"][0] == pytest.approx(-100.0 * result["length_capped"])
    expected = result["score"][0] + result["eos_penalty"][0] - 0.1 * result["kl"][0]
    assert result["objective"][0] == pytest.approx(expected)
