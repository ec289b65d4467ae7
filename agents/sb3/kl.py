"""The exact KL-regularised objective for SB3's on-policy algorithms (PPO, A2C, MaskablePPO).

TextRLHF-v0 pays r_t = β·log π_ref(a_t|s_t) (+ the score at the last step). Subtracting
β·log π_θ(a_t|s_t) of the agent's own sample — the log-prob SB3 stores in
``rollout_buffer.log_probs`` at sampling time — turns it into the per-token KL-penalised reward
r̂_t = −β·(log π_θ − log π_ref) (+ score), whose return is that of E[score] − β·KL(π_θ‖π_ref),
so every advantage SB3 builds on it estimates the KL-regularised policy gradient (the objective of
every textgym agent; README, "The PPO agent").

An entropy bonus ``ent_coef = β`` is not equivalent: it differentiates each visited state's
entropy but not how a token changes the entropies of the states after it, and SB3 normalises the
advantages per minibatch but not the entropy term. Hence ``ent_coef = 0`` with the penalty.

Example:
    >>> from stable_baselines3 import PPO  # doctest: +SKIP
    >>> model = PPO(LMPolicy, env, ent_coef=0.0)  # doctest: +SKIP
    >>> model.learn(4096, callback=KLPenaltyCallback())  # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
import torch
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.utils import obs_as_tensor
from stable_baselines3.common.vec_env import unwrap_vec_normalize

from textgym.envs import check_kl_coef

__all__ = ["KLPenaltyCallback", "apply_kl_penalty", "penalise_rewards"]


def penalise_rewards(rewards: np.ndarray, log_probs: np.ndarray, kl_coef: float) -> np.ndarray:
    """The KL-penalised rewards r̂ = r − β·log π_θ(a|s), in the rewards' dtype.

    Why the sampled log-prob: with the env's r = β·log π_ref (+ score), the return of r̂ is the
    score minus β times the sampled log-ratio, whose expectation is β·KL(π_θ‖π_ref).

    Args:
        rewards: the env's rewards, ``(n_steps, n_envs)`` (any shape equal to ``log_probs``'s).
        log_probs: log π_θ(a_t|s_t) of the sampled actions under the policy that sampled them.
        kl_coef: β >= 0.

    Raises:
        ValueError: the shapes differ, ``log_probs`` is not finite, or ``kl_coef`` is not a finite float >= 0.
    """
    rewards, log_probs = np.asarray(rewards), np.asarray(log_probs)
    if rewards.shape != log_probs.shape:
        raise ValueError(
            f"rewards of shape {rewards.shape} and log_probs of shape {log_probs.shape} must have the same shape "
            "(n_steps, n_envs)"
        )
    if not np.isfinite(log_probs).all():
        raise ValueError("log_probs holds non-finite values; each must be the finite log-prob of a sampled action")
    beta = check_kl_coef(kl_coef)
    return (rewards - beta * log_probs).astype(rewards.dtype, copy=False)  # (n_steps, n_envs)


def apply_kl_penalty(
    rollout_buffer: RolloutBuffer, kl_coef: float, last_values: torch.Tensor, dones: np.ndarray
) -> None:
    """Rewrite a full rollout buffer in place: rewards −= β·log_probs, then returns and advantages again.

    Why a rewrite after SB3's own GAE: SB3 has no reward hook between sampling and
    ``compute_returns_and_advantage``; recomputing with the same bootstrap replaces its result.

    Args:
        rollout_buffer: a full SB3 ``RolloutBuffer`` (or subclass: dict, maskable).
        kl_coef: β >= 0.
        last_values: V(s_T) of the observation after the last step, ``(n_envs, 1)``.
        dones: whether the last step ended each env's episode, ``(n_envs,)``.

    Raises:
        ValueError: the buffer is not full, or as :func:`penalise_rewards`.
    """
    if not rollout_buffer.full:
        raise ValueError(
            f"rollout_buffer holds {rollout_buffer.pos} of {rollout_buffer.buffer_size} steps; "
            "the penalty is applied to a full buffer, at rollout end"
        )
    rollout_buffer.rewards[...] = penalise_rewards(rollout_buffer.rewards, rollout_buffer.log_probs, kl_coef)
    rollout_buffer.compute_returns_and_advantage(last_values=last_values, dones=dones)


class KLPenaltyCallback(BaseCallback):
    """Optimise E[score] − β·KL(π_θ‖π_ref) exactly with SB3's ``PPO``, ``A2C`` or ``MaskablePPO``.

    At each rollout end the buffer's rewards become r − β·log π_θ(a|s) (the log-prob stored at
    sampling time; for MaskablePPO, that of the masked policy that sampled) and its returns and
    advantages are recomputed. Pass it to ``learn``; build the model with ``ent_coef=0``.

    Args:
        kl_coef: β. Default None reads the training env's ``kl_coef`` at every rollout end, so the
            penalty follows the β of the env's reward when it is changed between episodes. A β
            given here should equal the env's: otherwise the log-ratio is not a KL.
        verbose: SB3's verbosity level.

    Raises:
        TypeError: at ``learn`` start, the model is not an on-policy algorithm.
        ValueError: at ``learn`` start, ``ent_coef != 0``, rewards normalised by ``VecNormalize``,
            or (``kl_coef=None``) sub-envs with different ``kl_coef``.
        AttributeError: ``kl_coef=None`` and the training env has no ``kl_coef``.
    """

    def __init__(self, kl_coef: float | None = None, verbose: int = 0):
        super().__init__(verbose)
        self.kl_coef = None if kl_coef is None else check_kl_coef(kl_coef)

    def _init_callback(self) -> None:
        _check_model(self.model)
        self.current_kl_coef()  # a missing or ambiguous β fails now, not after the first rollout

    def current_kl_coef(self) -> float:
        """β: the one given, or the training env's ``kl_coef`` (all sub-envs must agree)."""
        if self.kl_coef is not None:
            return self.kl_coef
        try:
            values = self.training_env.get_attr("kl_coef")
        except AttributeError as err:
            raise AttributeError(
                "KLPenaltyCallback(kl_coef=None) reads β from the training env's kl_coef, which it lacks; "
                "give KLPenaltyCallback(kl_coef=β)"
            ) from err
        if len(set(values)) != 1:
            raise ValueError(
                f"the training env's sub-envs have kl_coef={values}; the penalty needs one β: "
                "give every sub-env the same kl_coef"
            )
        return check_kl_coef(values[0], name="training env kl_coef")

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        # sb3-contrib 2.9.2's MaskablePPO calls on_rollout_end without refreshing the callback's
        # locals, so locals["values"] there is V(s_{T-1}), not the bootstrap V(s_T): recompute it from
        # the last observation, as collect_rollouts does (policy still in eval mode: same numbers).
        new_obs, dones = self.locals["new_obs"], self.locals["dones"]
        with torch.no_grad():
            last_values = self.model.policy.predict_values(obs_as_tensor(new_obs, self.model.device))  # (n_envs, 1)
        apply_kl_penalty(self.model.rollout_buffer, self.current_kl_coef(), last_values, dones)


def _check_model(model) -> None:
    """Refuse the set-ups where the penalised reward would not be the KL-regularised objective."""
    if not isinstance(model, OnPolicyAlgorithm):
        raise TypeError(
            f"KLPenaltyCallback needs an on-policy algorithm with a rollout buffer (PPO, A2C, MaskablePPO); "
            f"got {type(model).__name__}"
        )
    ent_coef = getattr(model, "ent_coef", 0.0)
    if float(ent_coef) != 0.0:
        raise ValueError(
            f"ent_coef={ent_coef!r} with KLPenaltyCallback: the reward already carries −β·log π, so an "
            "entropy bonus would count the KL's entropy part twice; build the model with ent_coef=0.0"
        )
    vec_normalize = unwrap_vec_normalize(model.get_env())
    if vec_normalize is not None and vec_normalize.norm_reward:
        raise ValueError(
            "VecNormalize(norm_reward=True) rescales the env's rewards but not the −β·log π penalty, "
            "which changes β; use VecNormalize(norm_reward=False) (the env's normalize_reward "
            "standardises the reward-model score instead)"
        )
