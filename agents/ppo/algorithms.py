"""Where PPO, GRPO and RLOO differ: the advantage estimator (and whether a critic exists), chosen once.

Everything else (rollout, the clipped surrogate, the KL penalty, the update loop) is shared; the
trainer asks its estimator for the rollout's starts (prompts, partner seeds) and for the advantages, never for
``cfg.algo``.

* :class:`CriticGAE` (``ppo``): a learned per-token critic, GAE over the KL-penalised per-token rewards.
* :class:`GroupBaseline` (``grpo``, ``rloo``): G episodes per prompt; each episode's score against
  its group's (standardised or leave-one-out), the k1 KL return with β (:func:`.rollout.group_advantages`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from textgym.episodes import paid_score

from .advantages import compute_advantages, explained_variance, group_advantages
from .config import PPOConfig
from .models import TokenValues, make_critic

__all__ = ["CriticGAE", "GroupBaseline", "make_estimator"]


class CriticGAE:
    """PPO's estimator: GAE(γ, λ) over a learned critic ``critic`` (trained by the loss's value term)."""

    def __init__(self, cfg: PPOConfig, critic: torch.nn.Module, max_prompt_tokens: int):
        self.cfg, self.critic, self.max_prompt_tokens = cfg, critic, max_prompt_tokens

    def starts(self, envs, num_episodes: int, seed: int | None) -> tuple[dict[str, list] | None, int | None]:
        """Every slot draws its own prompt (seeded by the rollout with ``seed``)."""
        return None, seed

    @torch.no_grad()
    def advantages(self, data, episodes, log_ratio: torch.Tensor, kl_coef: float,
                   autocast: Callable) -> dict[str, float]:  # fmt: skip
        """Write ``advantage`` and ``value_target`` (B, T, 1) into ``data`` from its per-token ``reward``."""
        cfg = self.cfg
        with autocast():
            compute_advantages(data, TokenValues(self.critic, self.max_prompt_tokens), cfg.gamma, cfg.lmbda,
                               cfg.whiten_rewards)  # fmt: skip
        value, target = data["state_value"][..., 0], data["value_target"][..., 0]
        return {"explained_variance": explained_variance(value, target, data["mask"])}


class GroupBaseline:
    """GRPO's and RLOO's estimator: no critic; the baseline is the other episodes of the same prompt."""

    critic = None

    def __init__(self, cfg: PPOConfig):
        self.cfg = cfg

    def starts(self, envs, num_episodes: int, seed: int | None) -> tuple[dict[str, list] | None, int | None]:
        """One prompt (and, in a conversation, one partner seed: one game) per group of G consecutive slots,
        drawn with the group's first slot RNG: ``({"prompts": [...], "partner_seeds": [...]}, None)``, each
        entry repeated G times, as :func:`textgym.episodes.collect_episodes` takes them.

        On the first rollout (``seed`` given) the slots' prompt RNGs are seeded before the groups
        draw from them, so the rollout itself gets no seed.
        """
        if seed is not None:
            envs.reset(seed=seed)
        g = self.cfg.group_size
        if num_episodes % g:
            raise ValueError(f"num_episodes={num_episodes} must be a multiple of group_size={g} for "
                             f"algo={self.cfg.algo!r}")  # fmt: skip
        firsts = range(0, num_episodes, g)
        starts = {"prompts": [p for p in envs.unwrapped.draw_prompts(firsts) for _ in range(g)]}
        seeds = envs.unwrapped.draw_partner_seeds(firsts)
        if seeds is not None:
            starts["partner_seeds"] = [x for x in seeds for _ in range(g)]
        return starts, None

    @torch.no_grad()
    def advantages(self, data, episodes, log_ratio: torch.Tensor, kl_coef: float,
                   autocast: Callable) -> dict[str, float]:  # fmt: skip
        """Write ``advantage`` (B, T, 1) into ``data``: each episode's group advantage on every token.

        The groups take each episode's exact score from the env (not the per-token rewards minus
        β·log π_ref, whose float32 rounding would be noise that GRPO's 1/σ blows up) and its k1 KL
        return Σ_t log(π_old/π_ref), weighted by ``kl_coef`` (β, or 0 for a loss-side KL).
        """
        cfg = self.cfg
        scores = paid_score(episodes)  # the end's score minus the missing-EOS penalty, plus a partner's turn rewards
        scores = scores.to(log_ratio.device, torch.float32)  # (B,)
        advantage = group_advantages(scores, log_ratio.sum(1), cfg.group_size, cfg.algo, kl_coef,
                                     cfg.grpo_scale)  # (B,)  # fmt: skip
        data["advantage"] = (advantage[:, None] * data["mask"]).unsqueeze(-1)  # (B, T, 1)
        return {"group_score_std": float(scores.view(-1, cfg.group_size).std(1).mean())}


def make_estimator(cfg: PPOConfig, reward_model: Any, policy: torch.nn.Module,
                   max_prompt_tokens: int) -> CriticGAE | GroupBaseline:  # fmt: skip
    """The estimator of ``cfg.algo``; PPO's builds its critic (see :func:`.models.make_critic`)."""
    if cfg.algo != "ppo":
        return GroupBaseline(cfg)
    lora = (cfg.lora_rank, cfg.lora_alpha) if cfg.lora_rank else None
    return CriticGAE(cfg, make_critic(reward_model, policy, lora), max_prompt_tokens)
