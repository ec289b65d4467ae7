"""REINFORCE with a learned value baseline on TextRLHF-v0: the simplest policy gradient on the same episodes.

∇J ≈ Σ_t ∇log π(a_t|s_t)·(G_t − V(s_t)), with G_t the return-to-go (γ = 1) of the per-token
KL-penalised reward r̂_t = score_t − β·log(π/π_ref) (the k1 reward: its expected gradient is that
of E[score] − β·KL(π‖π_ref), the objective every textgym agent optimises). One gradient step
per batch of complete episodes from :func:`textgym.episodes.collect_episodes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from textgym.episodes import collect_episodes, make_episode_envs
from textgym.functional import masked_mean
from textgym.policies import LMSampler

from .ppo.advantages import per_token_rewards, sequence_batch
from .ppo.models import TokenLogProbs, TokenValues, make_actor, make_critic

__all__ = ["Reinforce", "reinforce_loss"]


def reinforce_loss(logp: torch.Tensor, values: torch.Tensor, reward: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Policy-gradient loss with a value baseline plus the value regression, over valid tokens.

    Args:
        logp: ``(B, T)`` log π_θ(a_t|s_t), differentiable.
        values: ``(B, T)`` V(s_t), differentiable.
        reward: ``(B, T)`` per-token rewards (0 on padding).
        mask: ``(B, T)`` valid tokens.
    """
    returns = reward.flip(1).cumsum(1).flip(1)  # (B, T) return-to-go, γ = 1
    advantage = (returns - values).detach()
    return -masked_mean(logp * advantage, mask) + 0.5 * masked_mean((values - returns).square(), mask)


@dataclass
class Reinforce:
    """The REINFORCE learner: a policy copied from π_ref, a critic from the RM, and the env they train on."""

    envs: object
    policy: torch.nn.Module
    critic: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: LMSampler
    seed: int
    iterations: int = 0
    env_steps: int = 0  # tokens generated in training episodes

    @classmethod
    def create(cls, env_kwargs: dict, num_envs: int, seed: int, lr: float = 1e-4, critic_lr: float = 1e-3,
               env_id: str = "TextRLHF-v0"):  # fmt: skip
        envs = make_episode_envs(env_id, num_envs, **env_kwargs)
        torch.manual_seed(seed)
        policy = make_actor(envs.unwrapped.model)
        critic = make_critic(envs.unwrapped.reward_model, policy)
        optimizer = torch.optim.AdamW([{"params": policy.parameters(), "lr": lr},
                                       {"params": critic.parameters(), "lr": critic_lr}])  # fmt: skip
        sampler = LMSampler.for_env(policy, envs, generator=torch.Generator().manual_seed(seed))
        return cls(envs, policy, critic, optimizer, sampler, seed)

    def iteration(self, num_episodes: int | None = None) -> dict[str, float]:
        """Collect complete episodes and take one gradient step.

        Returns the env steps so far and the episodes' means: the (normalised) RM score, the gold
        score and KL(π‖π_ref) per sequence (k1: Σ_t log π − log π_ref of the sampling policy).
        """
        base = self.envs.unwrapped
        episodes = collect_episodes(self.envs, self.sampler, num_episodes=num_episodes,
                                    seed=self.seed if self.iterations == 0 else None)  # fmt: skip
        d = sequence_batch(episodes)
        mask = d["mask"]
        beta = base.kl_coef
        reward, log_ratio = per_token_rewards(d["env_reward"], d["sample_log_prob"], d["ref_logprob"], mask, beta, beta)
        P = base.max_prompt_tokens
        logp, _, _ = TokenLogProbs(self.policy, P)(d["sequence"], d["sequence_mask"], mask, with_entropy=False)
        values = TokenValues(self.critic, P)(d["sequence"], d["sequence_mask"])[..., 0]  # ONE forward each
        loss = reinforce_loss(logp, values, reward, mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.policy.parameters()) + list(self.critic.parameters()), 1.0)
        self.optimizer.step()
        self.iterations += 1
        self.env_steps += int(mask.sum())
        return {
            "env_steps": self.env_steps,
            "score": float(episodes["score_reward"].mean()),
            "gold_score": float(episodes["gold_score"].mean()),
            "kl": float(log_ratio.sum(1).mean()),
        }
