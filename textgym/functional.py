"""Pure tensor helpers shared by the environment and the agents.

Everything here is a function of tensors only: no models, no state. Shapes are checked and a
mismatch raises a ``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "position_ids_from_mask",
    "gather_logprobs",
    "pack_mask",
    "sample_categorical",
    "unpack_mask",
]


def _check_same_shape(a: Tensor, b: Tensor, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} has shape {tuple(a.shape)} but {name_b} has {tuple(b.shape)}")


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from log-probs of tokens sampled from π.

    The value's expectation is one thing, the expected *gradient* of using it another
    ("A Comedy of Estimators", arXiv 2512.21852; all tested on an exact categorical):

    - as a reward (a constant to the policy gradient, E_π[∇log π · k]): k1 gives exactly
      ∇KL(π‖π_ref); k2 and k3 do not — never put them in a reward;
    - as a loss term with its gradient through ``logprob`` (samples held fixed, E_π[∇k]): k1
      gives 0, k2 gives ∇KL(π‖π_ref), k3 gives ∇KL(π_ref‖π) (the reverse KL; GRPO's term).

    Args:
        logprob: log π(a_t | s_t) of the sampled tokens, any shape.
        ref_logprob: log π_ref(a_t | s_t), same shape.
        estimator: ``"k1"`` (log-ratio, unbiased, can be negative), ``"k2"`` (½·log-ratio²) or
            ``"k3"`` ((ρ − 1) − log ρ with ρ = π_ref/π; unbiased and non-negative), after
            Schulman, "Approximating KL Divergence" (2020).

    Returns:
        The per-token estimate, same shape as the inputs.
    """
    _check_same_shape(logprob, ref_logprob, "logprob", "ref_logprob")
    log_ratio = logprob - ref_logprob  # log π/π_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"estimator={estimator!r} is not one of 'k1', 'k2', 'k3'")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over the positions where ``mask`` is true."""
    _check_same_shape(x, mask, "x", "mask")
    x = x * mask.to(x.dtype)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is true (0 where nothing is selected)."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the selected entries of ``x`` (Bessel-corrected by default)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    if unbiased:
        n = mask.to(x.dtype).sum()
        if n < 2:
            raise ValueError(f"masked_var needs at least 2 selected entries for unbiased=True, got {int(n)}")
        var = var * n / (n - 1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Standardise the selected entries of ``x`` to unit variance (and zero mean if ``shift_mean``).

    Entries outside the mask are returned unchanged. Used for advantage whitening, where the
    prompt and padding positions must not move the statistics.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, x)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids that skip padding: the k-th real token of a row gets position k.

    Works for left, right and interior padding; padding positions get 0.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def gather_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log-softmax(logits)[..., token]: the log-prob of ``tokens`` under ``logits``.

    Args:
        logits: ``(..., V)`` unnormalised scores.
        tokens: ``(...)`` token ids.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits has batch shape {tuple(logits.shape[:-1])} but tokens has {tuple(tokens.shape)}")
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def sample_categorical(logp: Tensor, generator: torch.Generator | None = None, block: int = 256) -> Tensor:
    """One index per row of ``logp`` ``(N, V)`` (log-probabilities), drawn by inverting each row's CDF.

    Why not ``torch.multinomial``: on the CPU it draws an exponential variate for every entry, 49k per
    row at SmolLM2's vocabulary: 30 ms per step for 16 rows on one thread, half the model's own step. Here
    one uniform per row walks the CDF in two levels: the row's blocks of ``block`` entries, then the
    entries of the block it lands in (2.7 ms; docs/performance.md). Sums run in float64, so each entry keeps its float32
    probability to ~1e-16 of the total. An entry of probability 0 (outside a top-k/top-p set) is
    never drawn.

    Args:
        logp: ``(N, V)`` log-probabilities (−inf or the dtype's lowest value for excluded entries;
            rows need not sum to 1 exactly: the draw is from each row's normalised weights).
        generator: the ``torch.Generator`` to draw from (None: torch's global RNG).
        block: entries per first-level block.

    Returns:
        ``(N,)`` int64 indices.
    """
    if logp.dim() != 2:
        raise ValueError(f"logp has shape {tuple(logp.shape)}; sample_categorical takes (N, V) log-probabilities")
    n, v = logp.shape
    probs = torch.softmax(logp.float(), dim=-1)  # (N, V)
    if v % block:
        probs = torch.nn.functional.pad(probs, (0, block - v % block))
    probs = probs.view(n, -1, block)  # (N, B, K)
    block_cdf = probs.sum(-1, dtype=torch.float64).cumsum(-1)  # (N, B), summed in float64 without a float64 copy
    u = torch.rand(n, 1, generator=generator, dtype=torch.float64, device=logp.device)  # (N, 1)
    b, rest = _invert_cdf(block_cdf, u * block_cdf[:, -1:])  # the block, and how far into it u lands
    within = probs[torch.arange(n, device=logp.device), b].double().cumsum(-1)  # (N, K)
    k, _ = _invert_cdf(within, rest.unsqueeze(-1))
    return b * block + k


def _invert_cdf(cdf: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """The first index whose CDF passes ``target`` ``(N, 1)``, and what is left of ``target`` past the CDF before it.

    A target at or past the end (float rounding) takes the last index of positive mass: the first at the CDF's
    maximum. Returns ``(N,)`` indices and ``(N,)`` remainders.
    """
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (N,)
    index = torch.where(index >= cdf.shape[-1], cdf.argmax(-1), index)
    before = torch.where(index > 0, cdf.gather(-1, (index - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    return index, target.squeeze(-1) - before


def pack_mask(mask: Tensor) -> Tensor:
    """A bool ``(..., V)`` mask packed 8 entries to a byte: ``(..., ceil(V / 8))`` uint8, little-endian bits.

    Why: a truncated sampling distribution's kept set is stored with every sampled token so the
    update can reuse it; at a 49k vocabulary a bool per entry would be 8x the memory.
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"mask has dtype {mask.dtype}; pack_mask takes a bool tensor")
    pad = (-mask.shape[-1]) % 8
    bits = torch.nn.functional.pad(mask, (0, pad)).view(*mask.shape[:-1], -1, 8).to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def unpack_mask(packed: Tensor, size: int) -> Tensor:
    """The inverse of :func:`pack_mask`: ``(..., W)`` uint8 → ``(..., size)`` bool, with ``size <= 8 W``."""
    if packed.dtype != torch.uint8 or not 8 * (packed.shape[-1] - 1) < size <= 8 * packed.shape[-1]:
        raise ValueError(f"packed has dtype {packed.dtype} and {packed.shape[-1]} bytes per row; unpack_mask needs "
                         f"uint8 with ceil(size / 8) bytes for size={size}")  # fmt: skip
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # (..., W, 8)
    return bits.flatten(-2)[..., :size].bool()
