"""Stable-Baselines3 on TextRLHF-v0: the LM policy starts as pi_ref; PPO, A2C and MaskablePPO run
with the exact KL penalty; dropout stays off in updates; the length cap is terminal."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from sb3_contrib import MaskablePPO
from stable_baselines3 import A2C, PPO
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from textgym.agents.sb3 import KLPenaltyCallback, LMPolicy, MaskableLMPolicy, apply_kl_penalty, penalise_rewards
from textgym.models import load_tokenizer
from textgym.policies import LMSampler


class RecordRewards(gym.Wrapper):
    """Keep every reward (and length-cap flag) the env returns, in step order."""

    def __init__(self, env):
        super().__init__(env)
        self.rewards, self.capped = [], []

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.rewards.append(reward)
        self.capped.append(bool(info.get("length_capped", False)))
        return obs, reward, terminated, truncated, info


def test_initial_action_distribution_is_pi_ref():
    env = gym.make("TextRLHF-v0", max_new_tokens=6)
    model = PPO(LMPolicy, env, n_steps=8, batch_size=8, seed=0)
    ref = LMSampler.for_env(env.unwrapped.model, env, temperature=1.0)
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
    probs = torch.softmax(env.unwrapped._engine.reference.next_logits[0], -1).numpy()
    order = np.argsort(-probs)
    k = int(np.searchsorted(np.cumsum(probs[order]), 0.9)) + 1  # smallest set with mass >= 0.9
    assert mask[order[:k]].all() and mask.sum() == k
    assert probs[mask].sum() >= 0.9
    assert gym.make("TextRLHF-v0").unwrapped.action_masks().all()  # no option: every token allowed


@pytest.mark.parametrize("algo", ["ppo", "a2c", "maskable_ppo"])
def test_sb3_algorithms_train_with_the_kl_penalty_and_predict(algo):
    kwargs = {"max_new_tokens": 4, "action_mask_top_p": 0.9 if algo == "maskable_ppo" else None}
    env = RecordRewards(gym.make("TextRLHF-v0", **kwargs))
    beta = env.unwrapped.kl_coef
    if algo == "ppo":
        model = PPO(LMPolicy, env, n_steps=8, batch_size=4, n_epochs=1, ent_coef=0.0, seed=0)
    elif algo == "a2c":
        model = A2C(LMPolicy, env, n_steps=4, ent_coef=0.0, seed=0)
    else:
        model = MaskablePPO(MaskableLMPolicy, env, n_steps=8, batch_size=4, n_epochs=1, ent_coef=0.0, seed=0)
    before = [p.detach().clone() for p in model.policy.parameters()]
    model.learn(total_timesteps=8, callback=KLPenaltyCallback())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.policy.parameters()))
    # the last rollout's rewards are the env's minus β·log π of the sampled tokens
    buffer = model.rollout_buffer
    env_rewards = np.float32(env.rewards[-buffer.buffer_size :]).reshape(-1, 1)  # (n_steps, 1)
    assert (buffer.log_probs < 0).any()  # a real penalty (a top-p mask of one token has log-prob 0)
    np.testing.assert_allclose(buffer.rewards, env_rewards - beta * buffer.log_probs, rtol=0, atol=1e-6)
    obs, _ = env.reset(seed=1)
    action, _ = model.predict(obs, deterministic=True)
    assert env.action_space.contains(int(action))


class KeepAdvantages(KLPenaltyCallback):
    """The penalty callback, keeping the advantages SB3 computed before its rewrite."""

    def _on_rollout_end(self) -> None:
        self.before = self.model.rollout_buffer.advantages.copy()  # (n_steps, n_envs)
        super()._on_rollout_end()


@pytest.mark.parametrize("algo", ["ppo", "maskable_ppo"])
def test_kl_penalty_keeps_sb3s_bootstrap_value(algo):
    """sb3-contrib leaves the callback's locals["values"] stale at on_rollout_end: V(s_T) must still be SB3's."""
    env = gym.make("TextRLHF-v0", max_new_tokens=4)
    algo_class, policy = (PPO, LMPolicy) if algo == "ppo" else (MaskablePPO, MaskableLMPolicy)
    model = algo_class(policy, env, n_steps=3, batch_size=3, n_epochs=1, gamma=0.9, seed=0)
    with torch.no_grad():  # a value head that tells states apart
        model.policy.value_net.weight.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(0))
        model.policy.value_net.bias.fill_(1.0)
    callback = KeepAdvantages()
    model.learn(total_timesteps=3, callback=callback)
    assert not callback.locals["dones"].any()  # the rollout ends mid-episode: SB3 bootstraps γ·V(s_T)
    # δ_{T-1} = r − β·log π + γ·V(s_T) − V(s_{T-1}): only the penalty may move the last advantage
    buffer, beta = model.rollout_buffer, env.unwrapped.kl_coef
    np.testing.assert_allclose(buffer.advantages[-1] - callback.before[-1], -beta * buffer.log_probs[-1], atol=1e-6)


# --- the exact KL penalty on a tabular 2-step MDP ----------------------------------------------
# States are prefixes: 0 = (), 1 = (0,), 2 = (1,); trajectory k = (a0, a1) = divmod(k, 2).
THETA = [[0.2, -0.1], [0.5, -0.3], [-0.4, 0.9]]  # π_θ logits per state
REF = [[0.1, 0.3], [-0.2, 0.4], [0.7, -0.5]]  # π_ref logits per state
SCORE = [1.0, -0.5, 0.3, 2.0]  # R(trajectory)
BETA = 0.5
ACTIONS = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 1]])  # (T=2, K=4): a_t of trajectory k
STATES = torch.tensor([[0, 0, 0, 0], [1, 1, 2, 2]])  # (T, K): s_t of trajectory k


def _tabular_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log π(a_t | s_t) of every trajectory, (T, K)."""
    return torch.log_softmax(logits, -1)[STATES, ACTIONS]


def _filled_buffer(log_probs: torch.Tensor, env_rewards: torch.Tensor) -> RolloutBuffer:
    """A real SB3 buffer holding the 4 trajectories side by side (n_envs=4, n_steps=2), values 0."""
    buffer = RolloutBuffer(2, spaces.Discrete(3), spaces.Discrete(2), device="cpu", gae_lambda=1.0, gamma=1.0, n_envs=4)
    for t in range(2):
        buffer.add(
            STATES[t].numpy(),
            ACTIONS[t].numpy(),
            env_rewards[t].numpy(),
            np.full(4, t == 0, dtype=np.float32),
            torch.zeros(4),
            log_probs[t].detach().float(),
        )
    return buffer


def _update_direction(theta: torch.Tensor, advantages: np.ndarray) -> torch.Tensor:
    """Σ_k p(k) Σ_t A_t ∇log π_θ(a_t|s_t): autograd of the surrogate with detached weights."""
    lp = _tabular_logprobs(theta)  # (T, K)
    weight = lp.sum(0).exp().detach()  # p_θ(trajectory), (K,)
    (grad,) = torch.autograd.grad((weight * (torch.as_tensor(advantages, dtype=lp.dtype) * lp).sum(0)).sum(), theta)
    return grad


def tabular_gradients() -> dict[str, torch.Tensor]:
    """∇J of the exact objective, and the update directions of the penalty and the ent_coef=β routes."""
    theta = torch.tensor(THETA, dtype=torch.float64, requires_grad=True)
    lp, lp_ref = _tabular_logprobs(theta), _tabular_logprobs(torch.tensor(REF, dtype=torch.float64))
    score = torch.tensor(SCORE, dtype=torch.float64)
    # exact: J(θ) = Σ_k p_θ(k) [R_k − β·log(p_θ(k)/p_ref(k))]
    exact = lp.sum(0).exp() * (score - BETA * (lp.sum(0) - lp_ref.sum(0)))
    (exact_grad,) = torch.autograd.grad(exact.sum(), theta)
    # the env's rewards: β·log π_ref(a_t|s_t), plus R at the last step
    env_rewards = (BETA * lp_ref).detach().clone()
    env_rewards[-1] += score
    buffer = _filled_buffer(lp, env_rewards)
    apply_kl_penalty(buffer, BETA, last_values=torch.zeros(4, 1), dones=np.ones(4))
    penalty_grad = _update_direction(theta, buffer.advantages)
    # ent_coef = β: the env's rewards, plus β·E[Σ_t H(π(·|s_t))] with the state distribution held fixed
    plain = _filled_buffer(lp, env_rewards)
    plain.compute_returns_and_advantage(last_values=torch.zeros(4, 1), dones=np.ones(4))
    log_pi = torch.log_softmax(theta, -1)  # (S, A)
    entropy = -(log_pi.exp() * log_pi).sum(-1)[STATES]  # (T, K)
    bonus = (lp.sum(0).exp().detach() * entropy.sum(0)).sum()
    (bonus_grad,) = torch.autograd.grad(BETA * bonus, theta)
    return {
        "exact": exact_grad,
        "penalty": penalty_grad,
        "ent_coef": _update_direction(theta, plain.advantages) + bonus_grad,
    }


def test_kl_penalty_gives_the_exact_kl_regularised_gradient():
    grads = tabular_gradients()
    torch.testing.assert_close(grads["penalty"], grads["exact"], atol=1e-6, rtol=0)
    # why not ent_coef=β: the bonus misses how the first token moves the second state's entropy
    # (measured: 0.0122 off on the first state's logits); the last token has no later state
    assert (grads["ent_coef"][0] - grads["exact"][0]).abs().max() > 1e-3
    torch.testing.assert_close(grads["ent_coef"][1:], grads["exact"][1:], atol=1e-6, rtol=0)


def test_penalise_rewards_subtracts_beta_logprob_and_checks_shapes():
    rewards = np.array([[1.0, 0.5]], dtype=np.float32)
    out = penalise_rewards(rewards, np.array([[-2.0, -0.5]], dtype=np.float32), 0.1)
    np.testing.assert_allclose(out, [[1.2, 0.55]], rtol=1e-6)
    assert out.dtype == np.float32
    with pytest.raises(ValueError, match="same shape"):
        penalise_rewards(rewards, np.zeros((2, 1)), 0.1)
    with pytest.raises(ValueError, match="kl_coef=-1"):
        penalise_rewards(rewards, np.zeros((1, 2)), -1)


def _cartpole(kl_coef=None):
    env = gym.make("CartPole-v1")
    if kl_coef is not None:
        env.unwrapped.kl_coef = kl_coef
    return env


@pytest.mark.parametrize(
    "make_model, error, match",
    [
        (lambda: PPO("MlpPolicy", _cartpole(0.1), n_steps=8, batch_size=8, ent_coef=0.01), ValueError, "ent_coef=0.01"),
        (
            lambda: PPO("MlpPolicy", VecNormalize(DummyVecEnv([lambda: _cartpole(0.1)])), n_steps=8, batch_size=8),
            ValueError,
            "norm_reward",
        ),
        (
            lambda: PPO(
                "MlpPolicy", DummyVecEnv([lambda: _cartpole(0.1), lambda: _cartpole(0.2)]), n_steps=8, batch_size=8
            ),
            ValueError,
            "kl_coef=\\[0.1, 0.2\\]",
        ),
        (lambda: PPO("MlpPolicy", _cartpole(), n_steps=8, batch_size=8), AttributeError, "kl_coef=β"),
    ],
    ids=["ent_coef", "vec_normalize", "sub_envs_disagree", "no_kl_coef"],
)
def test_kl_penalty_callback_refuses_what_would_not_be_the_kl_objective(make_model, error, match):
    with pytest.raises(error, match=match):
        make_model().learn(8, callback=KLPenaltyCallback())


def _tiny_gpt2(path) -> str:
    """A random-init GPT-2 with dropout 0.1 everywhere (its default) and the embedded tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = load_tokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=len(tok), resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1
    )
    GPT2LMHeadModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_lm_body_dropout_stays_off_in_sb3_updates(tmp_path):
    """SB3 switches to train mode for its update; the stored rollout log-probs must still be reproduced."""
    path = _tiny_gpt2(tmp_path / "gpt2")
    env = gym.make("TextRLHF-v0", model=path, max_new_tokens=4, normalize_reward=False)  # another π_ref: its own scale
    model = PPO(LMPolicy, env, n_steps=4, batch_size=4, policy_kwargs={"model_path": path}, seed=0)
    obs, _ = env.reset(seed=0)
    obs_t, _ = model.policy.obs_to_tensor(obs)
    model.policy.set_training_mode(False)  # as in collect_rollouts
    with torch.no_grad():
        actions, _, rollout_log_prob = model.policy(obs_t)
    model.policy.set_training_mode(True)  # as in train
    with torch.no_grad():
        _, update_log_prob, _ = model.policy.evaluate_actions(obs_t, actions)
    torch.testing.assert_close(update_log_prob, rollout_log_prob, atol=1e-6, rtol=0)


def test_length_cap_is_terminal_for_sb3():
    """No γ·V(s_T) bootstrap at the cap: the buffer's rewards are exactly the env's, with V = 5 everywhere."""
    env = RecordRewards(gym.make("TextRLHF-v0", max_new_tokens=3))
    model = PPO(LMPolicy, env, n_steps=6, batch_size=6, n_epochs=1, seed=0)
    with torch.no_grad():
        model.policy.value_net.bias.fill_(5.0)
    model.learn(total_timesteps=6)
    assert any(env.capped)  # at least one episode ended at the cap
    np.testing.assert_array_equal(model.rollout_buffer.rewards[:, 0], np.float32(env.rewards))
