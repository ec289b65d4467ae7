"""Rollout through the native vector env, per-token rewards, and GAE.

Why not a TorchRL collector: RLHF needs exactly one *complete* episode per slot per iteration
(the reward-model score comes at its end) laid out episode by episode, so that the update runs
one teacher-forced forward per sequence. TorchRL's collectors hand out fixed-length time slices
with auto-reset, which cut episodes across batches. So this loop drives the Gymnasium vector
env directly and produces the TensorDict that TorchRL's ``ClipPPOLoss`` and GAE consume.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.objectives.value.functional import generalized_advantage_estimate

from textgym.functional import kl_penalty, masked_mean, masked_whiten
from textgym.policies import LMPolicy

__all__ = ["EpisodeBatch", "collect", "per_token_rewards", "compute_advantages"]


@dataclass
class EpisodeBatch:
    """One rollout: a ``(B, T)`` TensorDict plus per-episode scores and timing."""

    data: TensorDict
    rm_score: np.ndarray
    score_reward: np.ndarray
    gold_score: np.ndarray
    seconds: float
    policy_seconds: float


def collect(envs, sampler: LMPolicy, seed: int | None = None, autocast=contextlib.nullcontext) -> EpisodeBatch:
    """Run one episode in every slot of a NEXT_STEP-autoreset vector env.

    A slot that finishes early is reset by the env on its next step; what it does after that
    is not recorded (it is cheap: a prefill and a few tokens).
    """
    start = time.perf_counter()
    base = envs.unwrapped
    n, T, P = envs.num_envs, base.max_new_tokens, base.max_prompt_tokens
    actions = np.zeros((n, T), dtype=np.int64)
    logps = torch.zeros(n, T, device=sampler.device)  # stays on the device: no per-token copy
    ref = np.zeros((n, T), dtype=np.float32)
    rewards = np.zeros((n, T), dtype=np.float32)
    length = np.zeros(n, dtype=np.int64)
    finished = np.zeros(n, dtype=bool)
    seq = np.zeros((n, P + T), dtype=np.int64)
    seq_mask = np.zeros((n, P + T), dtype=np.int64)
    scores = {k: np.zeros(n) for k in ("rm_score", "score_reward", "gold_score")}
    obs, _ = envs.reset(seed=seed)
    rows = np.arange(n)
    policy_seconds = 0.0
    while not finished.all():
        tp = time.perf_counter()
        with autocast():
            a, lp = sampler.act(obs)
        policy_seconds += time.perf_counter() - tp
        a_host = a.cpu().numpy()  # the one host copy per token: the action the env needs
        obs, r, terminated, truncated, info = envs.step(a_host)
        live = rows[~finished]
        t = length[live]
        actions[live, t] = a_host[live]
        live_t = torch.as_tensor(live, device=logps.device)
        logps[live_t, torch.as_tensor(t, device=logps.device)] = lp.float()[live_t]
        ref[live, t] = info["ref_logprob"][live]
        rewards[live, t] = r[live]
        length[live] += 1
        ended = live[(terminated | truncated)[live]]
        if not ended.size:
            continue
        seq[ended], seq_mask[ended] = obs["input_ids"][ended], obs["attention_mask"][ended]
        for k in scores:
            scores[k][ended] = info[k][ended]
        finished[ended] = True
    mask = np.arange(T)[None, :] < length[:, None]
    sequence = torch.as_tensor(seq)
    data = TensorDict(
        {
            "sequence": sequence.unsqueeze(1).expand(n, T, P + T),  # a view, not T copies
            "sequence_mask": torch.as_tensor(seq_mask).unsqueeze(1).expand(n, T, P + T),
            "action": torch.as_tensor(actions),
            "sample_log_prob": logps.cpu(),
            "ref_logprob": torch.as_tensor(ref),
            "env_reward": torch.as_tensor(rewards),
            "mask": torch.as_tensor(mask),
        },
        batch_size=[n, T],
    )
    return EpisodeBatch(data, scores["rm_score"], scores["score_reward"], scores["gold_score"],
                        time.perf_counter() - start, policy_seconds)  # fmt: skip


def per_token_rewards(
    env_reward: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    env_kl_coef: float,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's per-token reward r̂_t = −β·KL_t (+ score at the last token), from the env reward.

    The env pays r_t = β_env·log π_ref(a_t|s_t) (+ score − penalty at the end), so
    score_t = r_t − β_env·log π_ref, and r̂_t = score_t − β·kl(log π_old, log π_ref). With the
    k1 estimator and β = β_env this is r_t − β·log π_old(a_t|s_t).

    Args:
        env_reward, logprob, ref_logprob, mask: ``(B, T)``.
        env_kl_coef: the β the env used for this rollout.
        kl_coef: β of the per-token penalty (the same, normally).
        estimator: ``"k1"`` or ``"k3"``.

    Returns:
        ``(B, T)`` rewards (0 on padding) and the ``(B, T)`` per-token KL estimate.
    """
    kl = kl_penalty(logprob, ref_logprob, estimator) * mask
    score = (env_reward - env_kl_coef * ref_logprob) * mask
    return (score - kl_coef * kl) * mask, kl


@torch.no_grad()
def compute_advantages(
    data: TensorDict, value_fn, gamma: float, lmbda: float, whiten_rewards: bool = False
) -> TensorDict:
    """Old values (one critic forward per sequence), GAE with the episode end as terminal, whitening.

    Writes ``state_value``, ``advantage`` (whitened over valid tokens) and ``value_target``
    (``(B, T, 1)`` each) into ``data``; expects ``reward`` and ``mask`` ``(B, T)``.
    """
    mask = data["mask"]
    reward = data["reward"]
    if whiten_rewards:
        reward = masked_whiten(reward, mask, shift_mean=False)
    values = value_fn(data["sequence"], data["sequence_mask"]) * mask.unsqueeze(-1)  # (B, T, 1)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    # The last real token ends the episode (EOS or the length cap: the RM scores it either way);
    # padding after it is "done" too, so nothing flows back across the end.
    lengths = mask.sum(1, keepdim=True)
    t = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    done = (t >= lengths - 1).unsqueeze(-1)  # (B, T, 1)
    advantage, value_target = generalized_advantage_estimate(
        gamma, lmbda, values, next_values, reward.unsqueeze(-1), done, done
    )
    data["state_value"] = values
    data["value_target"] = value_target
    data["advantage"] = masked_whiten(advantage, mask.unsqueeze(-1))
    return data


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var[returns − values] / Var[returns] over valid tokens."""
    var_ret = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    var_err = masked_mean((returns - values - masked_mean(returns - values, mask)) ** 2, mask)
    return float(1 - var_err / var_ret.clamp(min=1e-8))
