"""Stable-Baselines3 on TextRLHF-v0: the LM policy starts as pi_ref; PPO, A2C and MaskablePPO run."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from sb3_contrib import MaskablePPO
from stable_baselines3 import A2C, PPO

from textgym.agents.sb3 import LMPolicy, MaskableLMPolicy
from textgym.policies import LMPolicy as CachedLMPolicy


def test_initial_action_distribution_is_pi_ref():
    env = gym.make("TextRLHF-v0", max_new_tokens=6)
    model = PPO(LMPolicy, env, n_steps=8, batch_size=8, seed=0)
    ref = CachedLMPolicy.for_env(env.unwrapped.model, env, temperature=1.0)
    obs, _ = env.reset(seed=0)
    for _ in range(4):
        obs_t, _ = model.policy.obs_to_tensor(obs)
        with torch.no_grad():
            sb3_probs = model.policy.get_distribution(obs_t).distribution.probs[0]
        ref_probs = torch.softmax(ref.logits(obs)[0], -1)
        torch.testing.assert_close(sb3_probs, ref_probs, atol=1e-5, rtol=1e-4)
        obs, *_ = env.step(int(torch.argmax(ref_probs)))
    assert model.policy.predict_values(obs_t).abs().max() == 0  # zero-initialised value head


def test_top_p_action_masks_hold_the_reference_top_p_set():
    env = gym.make("TextRLHF-v0", max_new_tokens=6, action_mask_top_p=0.9)
    env.reset(seed=0)
    mask = env.unwrapped.action_masks()
    probs = torch.softmax(env.unwrapped._engine.next_logits[0], -1).numpy()
    order = np.argsort(-probs)
    k = int(np.searchsorted(np.cumsum(probs[order]), 0.9)) + 1  # smallest set with mass >= 0.9
    assert mask[order[:k]].all() and mask.sum() == k
    assert probs[mask].sum() >= 0.9
    assert gym.make("TextRLHF-v0").unwrapped.action_masks().all()  # no option: every token allowed


@pytest.mark.parametrize("algo", ["ppo", "a2c", "maskable_ppo"])
def test_sb3_algorithms_train_and_predict(algo):
    kwargs = {"max_new_tokens": 4, "action_mask_top_p": 0.9 if algo == "maskable_ppo" else None}
    env = gym.make("TextRLHF-v0", **kwargs)
    beta = env.unwrapped.kl_coef
    if algo == "ppo":
        model = PPO(LMPolicy, env, n_steps=8, batch_size=4, n_epochs=1, ent_coef=beta, seed=0)
    elif algo == "a2c":
        model = A2C(LMPolicy, env, n_steps=4, ent_coef=beta, seed=0)
    else:
        model = MaskablePPO(MaskableLMPolicy, env, n_steps=8, batch_size=4, n_epochs=1, ent_coef=beta, seed=0)
    before = [p.detach().clone() for p in model.policy.parameters()]
    model.learn(total_timesteps=8)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.policy.parameters()))
    obs, _ = env.reset(seed=1)
    action, _ = model.predict(obs, deterministic=True)
    assert env.action_space.contains(int(action))
