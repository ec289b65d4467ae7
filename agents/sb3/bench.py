"""The benchmark's adapter for Stable-Baselines3: PPO, A2C and MaskablePPO on the task's env, within the budget.

Registered in :mod:`textgym.agents.benchmark` as ``sb3_ppo``, ``sb3_a2c`` and ``maskable_ppo``; SB3
learns whole rollouts of ``n_steps × n_envs``, so it takes the rollouts that fit in the budget.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

__all__ = ["train_sb3"]


class _SB3Sampler:
    """An SB3 policy acting on the native vector env's batched observations (masked as in training)."""

    def __init__(self, model, masked: bool, envs):
        self.model, self.masked, self.envs = model, masked, envs

    def reset(self) -> None:
        pass

    @torch.no_grad()
    def act(self, obs):
        policy = self.model.policy
        obs_t, _ = policy.obs_to_tensor(obs)
        dist = policy.get_distribution(obs_t)
        if self.masked:
            dist.apply_masking(torch.as_tensor(self.envs.unwrapped.action_masks()))
        actions = dist.get_actions()
        return actions, dist.log_prob(actions)


def _sb3_curve_callback():
    from stable_baselines3.common.callbacks import BaseCallback

    class SB3Curve(BaseCallback):
        """Logs each rollout's finished episodes: score, gold and Σ_t log π(a_t) − log π_ref(a_t) (k1 KL)."""

        def __init__(self, ctx):
            super().__init__()
            self.ctx, self.finished = ctx, []

        def _on_training_start(self) -> None:
            self.kl = np.zeros(self.training_env.num_envs)

        def _on_step(self) -> bool:
            logp = self.locals["log_probs"].detach().cpu().numpy()  # of the sampled actions (masked if masked)
            for i, info in enumerate(self.locals["infos"]):
                self.kl[i] += logp[i] - info["ref_logprob"]
                if "score_reward" in info:
                    self.finished.append((info["score_reward"], info["gold_score"], self.kl[i]))
                    self.kl[i] = 0.0
            return True

        def _on_rollout_end(self) -> None:
            if self.finished:
                score, gold, kl = np.mean(self.finished, axis=0)
                self.ctx.log(self.num_timesteps, score, gold, kl)
                self.finished = []

    return SB3Curve


def train_sb3(ctx, algo: str):
    """Train SB3's ``algo`` (``sb3_ppo``, ``sb3_a2c``, ``maskable_ppo``) within ``ctx.budget``; the eval policy factory.

    ``ctx`` is the benchmark's :class:`textgym.agents.benchmark.RunContext` (its env, budget, seed, curve log).
    """
    from sb3_contrib import MaskablePPO
    from stable_baselines3 import A2C, PPO
    from stable_baselines3.common.callbacks import CallbackList
    from stable_baselines3.common.env_util import make_vec_env

    from . import KLPenaltyCallback, MaskableLMPolicy
    from . import LMPolicy as SB3LMPolicy

    masked = algo == "maskable_ppo"
    if masked:
        ctx.env_kwargs["action_mask_top_p"] = 0.9  # trained and evaluated with the same masks
    env_kwargs = dict(ctx.env_kwargs)
    n_envs = min(ctx.num_envs, 8)  # SB3 steps sub-envs one by one and re-encodes every observation
    vec = make_vec_env(lambda: gym.make(ctx.env_id, **env_kwargs), n_envs=n_envs, seed=ctx.seed)
    model_path = env_kwargs.get("model", gym.spec(ctx.env_id).kwargs.get("model"))  # the task's π_ref
    common = {"ent_coef": 0.0, "seed": ctx.seed, "gamma": 1.0, "device": "cpu", "verbose": 0,
              "policy_kwargs": {"model_path": model_path}}  # fmt: skip
    n_steps = max(2, min(32, ctx.budget // n_envs))
    if algo == "sb3_a2c":
        n_steps = min(n_steps, 8)
        model = A2C(SB3LMPolicy, vec, n_steps=n_steps, learning_rate=1e-5, **common)
    else:
        cls, pol = (MaskablePPO, MaskableLMPolicy) if masked else (PPO, SB3LMPolicy)
        model = cls(pol, vec, n_steps=n_steps, batch_size=min(64, n_steps * n_envs), n_epochs=2,
                    learning_rate=3e-5, **common)  # fmt: skip

    rollout = n_steps * n_envs  # SB3 learns whole rollouts: take the ones that fit in the budget
    callbacks = CallbackList([KLPenaltyCallback(), _sb3_curve_callback()(ctx)])
    model.learn(total_timesteps=(ctx.budget // rollout) * rollout, callback=callbacks)
    ctx.env_steps = model.num_timesteps
    vec.close()
    return lambda envs: _SB3Sampler(model, masked, envs)
