"""GRPO and RLOO: group advantages on hand-computed cases, groups share a prompt, and they learn."""

import itertools
import math

import numpy as np
import pytest
import torch

from textgym.agents.ppo import PPOConfig, Trainer, algorithms, sources, train
from textgym.agents.ppo.advantages import group_advantages
from textgym.agents.ppo.config import PRESETS


def grpo(scores, kl, g, **kw):
    return group_advantages(torch.tensor(scores), torch.tensor(kl), g, "grpo", **kw)


def test_grpo_standardises_the_score_and_centres_the_kl_return_with_beta_unscaled():
    scores, kl = [1.0, 2.0, 3.0, 6.0], [0.5, 1.5, -1.0, 1.0]  # two groups of G = 2
    s = 1 / math.sqrt(2)  # (s − mean) / std with the unbiased std: ±(d/2) / (d/√2)
    beta = 0.1  # the KL part: −β·(K − mean K) = ∓β·0.5, ±β·1.0, never divided by the score's std
    expected = torch.tensor([-s + 0.05, s - 0.05, -s + 0.1, s - 0.1])
    torch.testing.assert_close(grpo(scores, kl, 2, kl_coef=beta, eps=0.0), expected)
    # Dr. GRPO (scale="none"): the score only centred
    torch.testing.assert_close(grpo(scores, kl, 2, kl_coef=beta, scale="none"),
                               torch.tensor([-0.5 + 0.05, 0.5 - 0.05, -1.5 + 0.1, 1.5 - 0.1]))  # fmt: skip


def test_an_equal_score_group_gets_exactly_zero_score_advantage_whatever_its_kl_noise():
    """The issue's case: a group with one score and KL noise of 1e-3 got |A| ~ 0.4 from (R − mean)/σ(R)."""
    noise = [1.6e-3, -0.9e-3, 0.2e-3, -0.5e-3]
    for score in (0.1, 1.0, -0.7, 0.0):  # 0.1·3 is not 0.3 in floats: the mean is not the value
        adv = grpo([score] * 4 + [0.0, 1.0, 1.0, 0.0], noise * 2, 4, kl_coef=0.0)
        assert torch.equal(adv[:4], torch.zeros(4)) and adv[4:].abs().min() > 0.5
        with_kl = grpo([score] * 4, noise, 4, kl_coef=0.05)
        torch.testing.assert_close(with_kl, -0.05 * (torch.tensor(noise) - torch.tensor(noise).mean()))
        assert with_kl.abs().max() < 1e-4  # β·noise, not noise/σ


def _tabular_kl_gradients(group_size: int, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact expected GRPO update's KL part and the exact ∇(−β·KL(π‖π_ref)) on a 2-token, 3-symbol MDP.

    Every sequence y = (a1, a2) and every group of G of them is enumerated, so both are exact
    expectations: E_groups[Σ_i A_kl,i · ∇log π(y_i)] / G against autograd of the exact KL.
    """
    torch.manual_seed(0)
    theta = torch.randn(1 + 3, 3, requires_grad=True)  # row 0: π(a1); row 1 + a1: π(a2 | a1)
    ref = torch.randn(1 + 3, 3).log_softmax(-1)
    seqs = list(itertools.product(range(3), repeat=2))

    def seq_logp(logits):  # (9,) log-prob of each sequence
        lp = logits.log_softmax(-1)
        return torch.stack([lp[0, a] + lp[1 + a, b] for a, b in seqs])

    logp, ref_lp = seq_logp(theta), seq_logp(ref)
    kl = (logp.exp() * (logp - ref_lp)).sum()
    exact = torch.autograd.grad(-beta * kl, theta, retain_graph=True)[0]
    grad_logp = torch.stack([torch.autograd.grad(logp[i], theta, retain_graph=True)[0] for i in range(len(seqs))])
    p, k = logp.exp().detach(), (logp - ref_lp).detach()  # K_i: the k1 return of sequence i
    expected = torch.zeros_like(theta)
    for group in itertools.product(range(len(seqs)), repeat=group_size):
        idx = torch.tensor(group)
        adv = group_advantages(torch.zeros(group_size), k[idx], group_size, "grpo", kl_coef=beta)  # scores equal
        expected += p[idx].prod() * (adv[:, None, None] * grad_logp[idx]).sum(0) / group_size
    return expected, exact


def test_the_expected_grpo_kl_update_is_the_exact_kl_gradient_direction():
    """Centred by a mean that includes the sample, the KL part is (G − 1)/G of ∇(−β·KL): the same direction."""
    for g in (2, 3):
        expected, exact = _tabular_kl_gradients(g, beta=0.3)
        torch.testing.assert_close(expected, (g - 1) / g * exact, rtol=1e-4, atol=1e-6)


def test_rloo_baseline_is_the_mean_of_the_others():
    scores = torch.tensor([1.0, 2.0, 6.0])
    # baselines (2 + 6)/2 = 4, (1 + 6)/2 = 3.5, (1 + 2)/2 = 1.5; the KL return enters R = s − β·K
    torch.testing.assert_close(group_advantages(scores, torch.zeros(3), 3, "rloo", kl_coef=0.1),
                               torch.tensor([-3.0, -1.5, 4.5]))  # fmt: skip
    torch.testing.assert_close(group_advantages(torch.zeros(3), scores, 3, "rloo", kl_coef=0.1),
                               -0.1 * torch.tensor([-3.0, -1.5, 4.5]))  # fmt: skip


def test_rloo_baseline_excludes_the_sample_itself():
    """Unbiased: each episode's baseline R_i − A_i does not depend on its own return R_i."""
    zeros = torch.zeros(8)
    jac = torch.autograd.functional.jacobian(lambda r: r - group_advantages(r, zeros, 4, "rloo", 0.0), torch.randn(8))
    assert torch.equal(jac.diagonal(), torch.zeros(8))
    assert (jac.abs().sum() > 0) and torch.equal(jac[:4, 4:], torch.zeros(4, 4))  # only the own group counts


def test_group_advantage_arguments_are_checked():
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(6), torch.zeros(6), 4, "grpo", 0.1)
    with pytest.raises(ValueError, match="algo='ppo'"):
        group_advantages(torch.zeros(4), torch.zeros(4), 2, "ppo", 0.1)
    with pytest.raises(ValueError, match="kl_returns has shape"):
        group_advantages(torch.zeros(4), torch.zeros(3), 2, "grpo", 0.1)
    with pytest.raises(ValueError, match="scale='mad' is not one of"):
        group_advantages(torch.zeros(4), torch.zeros(4), 2, "grpo", 0.1, scale="mad")
    with pytest.raises(ValueError, match="grpo_scale='mad'"):
        PPOConfig(algo="grpo", grpo_scale="mad")


def test_the_trainer_gives_groups_the_env_score_and_the_k1_return(tmp_path, monkeypatch):
    """What the trainer hands group_advantages: the env's exact scores and Σ_t log π_old/π_ref, β unscaled."""
    seen = {}
    real = algorithms.group_advantages
    monkeypatch.setattr(algorithms, "group_advantages",
                        lambda *a, **kw: seen.setdefault("args", a) is not None and real(*a, **kw))  # fmt: skip
    t = Trainer.create(PPOConfig(**{**PRESETS["tiny"], "out": str(tmp_path / "run"), "algo": "grpo",
                                    "group_size": 4, "precision": "fp32"}))  # fmt: skip
    t.iteration()
    scores, kl, g, algo, beta, scale = seen["args"]
    ep = t.last_episodes
    assert torch.equal(scores, (ep["score_reward"] - ep["missing_eos_penalty"]).float())
    torch.testing.assert_close(kl, ((ep["sample_log_prob"] - ep["ref_logprob"]) * ep["mask"]).sum(1),
                               atol=1e-4, rtol=0)  # log π_old is the teacher-forced one  # fmt: skip
    assert (g, algo, beta, scale) == (4, "grpo", t.last_beta, "std")


def test_config_checks_the_groups():
    with pytest.raises(ValueError, match="group_size=3 must be >= 2 and divide num_envs=8"):
        PPOConfig(algo="grpo", num_envs=8, num_minibatches=2, group_size=3)
    with pytest.raises(ValueError, match="algo='dpo'"):
        PPOConfig(algo="dpo")
    PPOConfig(algo="ppo", num_envs=8, num_minibatches=2, group_size=3)  # groups are GRPO/RLOO's only


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_a_group_is_g_episodes_on_one_prompt_and_there_is_no_critic(tmp_path, monkeypatch, algo):
    seen = []
    real = sources.collect_episodes
    monkeypatch.setattr(sources, "collect_episodes", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
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
