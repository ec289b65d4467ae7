"""From complete episodes to the PPO update's layout: per-token rewards, and GAE.

Episodes come from :func:`textgym.episodes.collect_episodes`, the one episode loop; this module
lays them out for TorchRL's ``ClipPPOLoss`` and GAE.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torchrl.objectives.value.functional import generalized_advantage_estimate

from textgym.functional import masked_mean, masked_whiten

from .config import GROUP_SCALES

__all__ = [
    "compute_advantages",
    "explained_variance",
    "group_advantages",
    "per_token_rewards",
    "sampler_mismatch",
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
    if "kept" in episodes.keys():  # (B, T, W) the sampler's packed kept sets: the update's distribution too
        data["kept"] = episodes["kept"]
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
    width = max(last_column(data["mask"]), 1)
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
def sampler_mismatch(
    old_logprob: torch.Tensor, sampler_logprob: torch.Tensor, mask: torch.Tensor, cap: float | None
) -> dict[str, torch.Tensor | float]:
    """How far the sampler's log-probs are from the learner's π_old, and the truncated importance weights.

    The rollout's cached decode and the update's teacher-forced forward compute the same
    distribution with other kernels (and, under bf16, other roundings), so tokens come from
    π_sampler while the objective and the ratio are taken under π_old. The truncated importance
    weight w_t = min(π_old/π_sampler, C) on each token's policy-gradient term corrects for it
    (Yao et al., 2025; C bounds the variance a rare large ratio would add).

    Args:
        old_logprob, sampler_logprob, mask: ``(B, T)``.
        cap: C >= 1, or None (weights reported, all 1).

    Returns:
        ``tis_weight`` ``(B, T)`` (0 on padding), and the floats ``logprob_mismatch_max`` and
        ``logprob_mismatch_mean`` (|log π_old − log π_sampler| over valid tokens),
        ``tis_weight_mean`` and ``tis_capped_fraction`` (tokens whose weight hit C).
    """
    if not old_logprob.shape == sampler_logprob.shape == mask.shape:
        raise ValueError(f"old_logprob {tuple(old_logprob.shape)}, sampler_logprob {tuple(sampler_logprob.shape)} "
                         f"and mask {tuple(mask.shape)} must have one shape (B, T)")  # fmt: skip
    mask = mask.bool()
    gap = torch.where(mask, old_logprob - sampler_logprob, 0.0)  # log π_old/π_sampler
    ratio = gap.exp()
    capped = mask & (ratio > cap) if cap is not None else torch.zeros_like(mask)
    weight = torch.where(mask, ratio.clamp(max=cap) if cap is not None else torch.ones_like(ratio), 0.0)
    return {
        "tis_weight": weight,
        "logprob_mismatch_max": float(gap.abs().max()),
        "logprob_mismatch_mean": float(masked_mean(gap.abs(), mask)),
        "tis_weight_mean": float(masked_mean(weight, mask)),
        "tis_capped_fraction": float(masked_mean(capped.float(), mask)),
    }


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
    advantage, value_target = _masked_gae(gamma, lmbda, values, reward.unsqueeze(-1), mask)
    data["state_value"] = values
    data["value_target"] = value_target
    data["advantage"] = masked_whiten(advantage, mask.unsqueeze(-1))
    return data


def last_column(mask: torch.Tensor) -> int:
    """One past the last True column of any row of a ``(B, T)`` mask (0 when none is): the width a batch needs."""
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return int((mask.bool() * cols).max()) if mask.numel() else 0


def _masked_gae(gamma: float, lmbda: float, values: torch.Tensor, reward: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """GAE over the masked tokens of each row, as if the others were not there; ``(B, T, 1)`` in and out.

    Why pack: in a conversation the partner's replies sit between the policy's turns (mask False). They
    are observation, not steps: the policy's next state after its turn's last token is the state where it
    speaks again, so V and the rewards must chain from one policy token to the next. The masked columns
    are moved behind the policy's (a stable sort keeps their order), GAE runs on that prefix layout, and
    the result goes back to the original columns. With a prefix mask (single-turn) the order is the
    identity and the result is exactly the unpacked GAE's.
    """
    order = torch.sort((~mask.bool()).to(torch.int8), dim=1, stable=True).indices.unsqueeze(-1)  # (B, T, 1)
    packed_values, packed_reward = values.gather(1, order), reward.gather(1, order)
    next_values = torch.cat([packed_values[:, 1:], torch.zeros_like(packed_values[:, :1])], dim=1)
    # The last policy token ends the episode (EOS, a cap, or the partner's done: the score is paid there);
    # padding after it is "done" too, so nothing flows back across the end.
    lengths = mask.sum(1, keepdim=True)
    t = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
    done = (t >= lengths - 1).unsqueeze(-1)  # (B, T, 1)
    advantage, value_target = generalized_advantage_estimate(
        gamma, lmbda, packed_values, next_values, packed_reward, done, done
    )
    unpack = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device)
                                              .view(1, -1, 1).expand_as(order))  # fmt: skip
    return advantage.gather(1, unpack), value_target.gather(1, unpack)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var[returns − values] / Var[returns] over valid tokens."""
    var_ret = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    var_err = masked_mean((returns - values - masked_mean(returns - values, mask)) ** 2, mask)
    return float(1 - var_err / var_ret.clamp(min=1e-8))


def group_advantages(
    scores: torch.Tensor,
    kl_returns: torch.Tensor,
    group_size: int,
    algo: str,
    kl_coef: float,
    scale: str = "std",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Critic-free advantages of groups of G episodes on one prompt (consecutive rows).

    The objective is that of every algorithm here, E[score] − β·KL(π‖π_ref), with the KL entering as
    the k1 return K_i = Σ_t log(π_old/π_ref)(a_t|s_t) of each episode, β unscaled:

    - ``rloo``: R_i − mean_{j ≠ i} R_j with R = score − β·K, the leave-one-out baseline (Ahmadian
      et al., 2024): it does not depend on R_i, so the estimate of ∇(E[score] − β·KL) is unbiased.
    - ``grpo``: (s_i − mean_g s) / (std_g s + eps) − β·(K_i − mean_g K). The score part is GRPO's
      group standardisation (Shao et al., 2024; ``scale="none"``: only centred, Dr. GRPO, Liu et al.,
      2025); the KL part is centred by the same group mean but never divided by the score's std: a
      group with σ_g ≈ 0 would otherwise turn β into β/σ_g and its KL noise into ±1 advantages.
      Centring on a mean that includes the sample scales each part's expected gradient by
      (G − 1)/G, so ``scale="none"`` follows ∇(E[score] − β·KL) exactly in direction. With ``std``
      the KL part still does, but the score part is GRPO's self-normalised estimator: σ_g is the
      group's own sample std (random, and a function of s_i), so it follows no closed-form
      objective — a biased, scale-free step toward higher scores.
      A group whose scores are all equal gets exactly 0 score advantage: it carries no score signal.

    Args:
        scores: ``(B,)`` each episode's score (the reward model's, minus a missing-EOS penalty), B a
            multiple of ``group_size``.
        kl_returns: ``(B,)`` each episode's Σ_t log(π_old/π_ref) (zeros when the KL is a loss term).
        group_size: G >= 2.
        algo: ``"grpo"`` or ``"rloo"``.
        kl_coef: β of the k1 KL return (0 when the KL enters the loss instead).
        scale: ``grpo``'s score scaling, ``"std"`` or ``"none"``.

    Returns:
        ``(B,)`` advantages, one per episode (every token of it gets the same one).
    """
    if scores.dim() != 1 or group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(f"scores of shape {tuple(scores.shape)} must be (B,) with B a multiple of "
                         f"group_size={group_size} >= 2")  # fmt: skip
    if kl_returns.shape != scores.shape:
        raise ValueError(f"kl_returns has shape {tuple(kl_returns.shape)} but scores has {tuple(scores.shape)}")
    if scale not in GROUP_SCALES:
        raise ValueError(f"scale={scale!r} is not one of {GROUP_SCALES}")
    s, k = scores.view(-1, group_size), kl_returns.view(-1, group_size)  # (B/G, G)
    if algo == "rloo":
        r = s - kl_coef * k
        return (r - (r.sum(1, keepdim=True) - r) / (group_size - 1)).view(-1)
    if algo != "grpo":
        raise ValueError(f"algo={algo!r} is not one of 'grpo', 'rloo'")
    centred = s - s.mean(1, keepdim=True)
    if scale == "std":
        centred = centred / (s.std(1, keepdim=True) + eps)
    signal = (s.amax(1, keepdim=True) > s.amin(1, keepdim=True)).to(centred.dtype)  # 0: every score equal
    return (centred * signal - kl_coef * (k - k.mean(1, keepdim=True))).view(-1)
