"""GRPO and RLOO: group advantages on hand-computed cases, groups share a prompt, and they learn."""

import math

import numpy as np
import pytest
import torch

from textgym.agents.ppo import PPOConfig, Trainer, train
from textgym.agents.ppo import trainer as trainer_module
from textgym.agents.ppo.config import PRESETS
from textgym.agents.ppo.rollout import group_advantages


def test_grpo_advantages_are_group_standardised_returns():
    returns = torch.tensor([1.0, 2.0, 3.0, 6.0])  # two groups of G = 2
    s = 1 / math.sqrt(2)  # (R − mean) / std with the unbiased std: ±(d/2) / (d/√2)
    torch.testing.assert_close(group_advantages(returns, 2, "grpo", eps=0.0), torch.tensor([-s, s, -s, s]))
    same = group_advantages(torch.tensor([5.0, 5.0, 5.0]), 3, "grpo")
    assert (same == 0).all()  # a group with one outcome teaches nothing


def test_rloo_baseline_is_the_mean_of_the_others():
    returns = torch.tensor([1.0, 2.0, 6.0])
    # baselines (2 + 6)/2 = 4, (1 + 6)/2 = 3.5, (1 + 2)/2 = 1.5
    torch.testing.assert_close(group_advantages(returns, 3, "rloo"), torch.tensor([-3.0, -1.5, 4.5]))


def test_rloo_baseline_excludes_the_sample_itself():
    """Unbiased: each episode's baseline R_i − A_i does not depend on its own return R_i."""
    jac = torch.autograd.functional.jacobian(lambda r: r - group_advantages(r, 4, "rloo"), torch.randn(8))
    assert torch.equal(jac.diagonal(), torch.zeros(8))
    assert (jac.abs().sum() > 0) and torch.equal(jac[:4, 4:], torch.zeros(4, 4))  # only the own group counts


def test_group_advantage_shapes_are_checked():
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(6), 4, "grpo")
    with pytest.raises(ValueError, match="algo='ppo'"):
        group_advantages(torch.zeros(4), 2, "ppo")


def test_config_checks_the_groups():
    with pytest.raises(ValueError, match="group_size=3 must be >= 2 and divide num_envs=8"):
        PPOConfig(algo="grpo", num_envs=8, num_minibatches=2, group_size=3)
    with pytest.raises(ValueError, match="algo='dpo'"):
        PPOConfig(algo="dpo")
    PPOConfig(algo="ppo", num_envs=8, num_minibatches=2, group_size=3)  # groups are GRPO/RLOO's only


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_a_group_is_g_episodes_on_one_prompt_and_there_is_no_critic(tmp_path, monkeypatch, algo):
    seen = []
    real = trainer_module.collect_episodes
    monkeypatch.setattr(trainer_module, "collect_episodes", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    cfg = PPOConfig(**{**PRESETS["tiny"], "out": str(tmp_path / "run"), "algo": algo, "group_size": 4})
    t = Trainer.create(cfg)
    assert t.critic is None and len(t.optimizer.param_groups) == 1
    row = t.iteration()
    prompts = list(seen[-1]["prompt"])
    assert [len(set(prompts[i : i + 4])) for i in range(0, 8, 4)] == [1, 1]
    assert prompts[0] != prompts[4] or len(set(t.envs.unwrapped.prompts)) == 1
    assert "value_loss" not in row and math.isfinite(row["policy_loss"])


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_critic_free_algorithms_raise_the_rm_score_on_a_fixed_seed(tmp_path, algo):
    cfg = PPOConfig(algo=algo, group_size=4, total_episodes=32 * 14, num_envs=32, max_new_tokens=12,
                    num_minibatches=2, seed=0, learning_rate=5e-4, target_kl=None, kl_coef=0.05,
                    out=str(tmp_path / "run"), progress=False, checkpoint_every=100)  # fmt: skip
    history = train(cfg)
    first = np.mean([r["score"] for r in history[:3]])
    last = np.mean([r["score"] for r in history[-3:]])
    assert last > first + 0.5, (first, last)
    assert all(math.isfinite(r["kl"]) for r in history)
