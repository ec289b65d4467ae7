"""From complete episodes to the PPO update's layout: per-token rewards, and GAE.

Episodes come from :func:`textgym.episodes.collect_episodes`, the one episode loop; this module
lays them out for TorchRL's ``ClipPPOLoss`` and GAE.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torchrl.objectives.value.functional import generalized_advantage_estimate

from textgym.functional import masked_mean, masked_whiten

__all__ = [
    "compute_advantages",
    "explained_variance",
    "group_advantages",
    "per_token_rewards",
    "sequence_batch",
    "trim_columns",
]

PER_TOKEN_KEYS = ("action", "sample_log_prob", "ref_logprob", "env_reward", "mask")


def sequence_batch(episodes: TensorDict) -> TensorDict:
    """``(B,)`` episodes → the ``(B, T)`` update layout.

    Per-token fields become the batch's columns; the finished sequence (``(B, L)``) is expanded
    along T as a view (not T copies), so the actor and critic run ONE forward per sequence.
    """
    B, T = episodes["action"].shape
    seq, seq_mask = episodes["input_ids"], episodes["attention_mask"]
    data = {k: episodes[k] for k in PER_TOKEN_KEYS}
    data["sequence"] = seq.unsqueeze(1).expand(B, T, seq.shape[-1])  # (B, T, L)
    data["sequence_mask"] = seq_mask.unsqueeze(1).expand(B, T, seq.shape[-1])
    return TensorDict(data, batch_size=[B, T])


def trim_columns(data: TensorDict, prompt_len: int) -> TensorDict:
    """``data`` cut to its longest response: T' = max valid tokens of a row, L' = ``prompt_len`` + T'.

    Why: the columns past every row's end are padding in every row, yet a forward and backward
    over them cost as much as over real tokens. Causal attention makes the kept logits and values
    exactly those of the full width. The sequence view is sliced, not copied.
    """
    T = data.batch_size[1]
    width = max(int(data["mask"].sum(1).max()), 1)
    if width == T:
        return data
    out = data[:, :width]
    out["sequence"] = data["sequence"][:, :width, : prompt_len + width]
    out["sequence_mask"] = data["sequence_mask"][:, :width, : prompt_len + width]
    return out


def per_token_rewards(
    env_reward: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    env_kl_coef: float,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's per-token reward r̂_t = score_t − β·(log π_old − log π_ref), from the env reward.

    The env pays r_t = β_env·log π_ref(a_t|s_t) (+ score − penalty at the end), so
    score_t = r_t − β_env·log π_ref, and with β = β_env, r̂_t = r_t − β·log π_old(a_t|s_t).
    Only the k1 estimate belongs in a reward: a reward is a constant to the policy gradient,
    and E_π[∇log π · k1] = ∇KL(π‖π_ref) exactly, while k2/k3 as rewards have other expected
    gradients (Schulman 2020; "A Comedy of Estimators", arXiv 2512.21852). ``kl_coef = 0``
    gives the score alone, for a loss-side KL term.

    Args:
        env_reward, logprob, ref_logprob, mask: ``(B, T)``.
        env_kl_coef: the β the env used for this rollout.
        kl_coef: β of the per-token penalty (the same, or 0 when the KL is a loss term).

    Returns:
        ``(B, T)`` rewards (0 on padding) and the ``(B, T)`` per-token log-ratio log π_old − log π_ref.
    """
    log_ratio = (logprob - ref_logprob) * mask
    score = (env_reward - env_kl_coef * ref_logprob) * mask
    return (score - kl_coef * log_ratio) * mask, log_ratio


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


def group_advantages(returns: torch.Tensor, group_size: int, algo: str, eps: float = 1e-6) -> torch.Tensor:
    """Critic-free advantages of groups of G episodes on one prompt (consecutive rows).

    ``grpo``: (R_i − mean_g R) / (std_g R + eps), the group-standardised return of GRPO (Shao
    et al., 2024, DeepSeekMath). ``rloo``: R_i − mean_{j ≠ i} R_j, the leave-one-out baseline
    (Ahmadian et al., 2024): it does not depend on R_i, so the estimate stays unbiased.

    Args:
        returns: ``(B,)`` episode returns, B a multiple of ``group_size``.
        group_size: G >= 2.
        algo: ``"grpo"`` or ``"rloo"``.

    Returns:
        ``(B,)`` advantages, one per episode (every token of it gets the same one).
    """
    if returns.dim() != 1 or group_size < 2 or returns.shape[0] % group_size:
        raise ValueError(f"returns of shape {tuple(returns.shape)} must be (B,) with B a multiple of "
                         f"group_size={group_size} >= 2")  # fmt: skip
    r = returns.view(-1, group_size)  # (B/G, G)
    if algo == "grpo":
        return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)
    if algo == "rloo":
        return (r - (r.sum(1, keepdim=True) - r) / (group_size - 1)).view(-1)
    raise ValueError(f"algo={algo!r} is not one of 'grpo', 'rloo'")
