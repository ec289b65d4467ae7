"""The evaluator's objective is the env's: score − missing-EOS penalty − β·KL (issue 37.8)."""

from __future__ import annotations

import pytest

from textgym.agents.evaluate import evaluate


def test_objective_subtracts_the_missing_eos_penalty_the_env_pays():
    """Responses cut at 2 tokens pay the env's penalty; the objective reported must pay it too."""
    result = evaluate(episodes=4, num_envs=4, max_new_tokens=2, missing_eos_penalty=100.0, kl_coef=0.1,
                      normalize_reward=False)  # fmt: skip
    assert result["objective"][0] < result["score"][0] - 50.0  # most responses are capped at 2 tokens
    assert result["missing_eos_penalty"][0] == pytest.approx(100.0 * result["length_capped"])
    expected = result["score"][0] - result["missing_eos_penalty"][0] - 0.1 * result["kl"][0]
    assert result["objective"][0] == pytest.approx(expected)
    # issue 43.3: the penalty has the setting's name and sign; the old key (−penalty) stays for one version
    assert result["eos_penalty"] == (-result["missing_eos_penalty"][0], result["missing_eos_penalty"][1])


class _Pays:
    """Answers each turn with a reward of 0.25 and ends the game after two turns."""

    def reset(self, *, seed, prompt):
        self.k = 0

    def reply(self, conversation):
        self.k += 1
        return "again", 0.25, self.k >= 2


def test_score_is_one_sum_in_the_results_and_the_samples():
    """Issue 43.3: ``score`` was the end's score plus a partner's rewards in the results and the trainer's metrics, but
    the end's score alone in the samples (0.5 here instead of 1.0)."""
    result = evaluate(None, episodes=2, num_envs=2, env_id="TextMultiTurn-v0", partner=_Pays, max_turn_tokens=2,
                      max_new_tokens=24, reward_model=lambda prompts, responses: [0.5] * len(prompts),
                      normalize_reward=False, gold_scorer=None, progress=False)  # fmt: skip
    for sample in result["samples"]:
        assert sample["turn_reward_sum"] == 0.5 and sample["score"] == 1.0
    assert result["score"][0] == 1.0
