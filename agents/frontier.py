"""The reward–KL frontier of a training run, after Gao et al. (2022), "Scaling Laws for Reward Model Overoptimization".

A run is summarised by the gold reward it buys per unit of divergence from π_ref, with
d = √KL(π‖π_ref) (nats per sequence). Gao et al. found that for RL the gold reward gained over
π_ref follows

    R(d) = d (α − β log d)

which rises, peaks at d* = exp(α/β − 1) and falls (over-optimisation of the proxy). The form is
linear in (α, β), so it is fitted by least squares on the (d, R) points a run logs during
training, with R = reward − reward of π_ref.

The summary number is the area under the *frontier*: the best fitted gain within a KL budget,
F(d) = max(0, max over the run's points d_i ≤ d of R(d_i)), averaged over the KL budget
k ∈ [0, KL_max] in nats (F read at d = √k): users state budgets in nats, and an average over √KL
would weigh the small KLs more (the first half of the d range is the first quarter in nats). The
maximum is there because a policy can always stop early (π_ref itself is F(0) = 0); the fit is
read at the KLs the run reached only, because a run earns no credit for KL it never reached and a
two-parameter curve read between or past its points is not a measurement (on a few noisy points
near d = 0 it can rise and fall to any height). The fit is what smooths each point's noise.
Dividing by ``KL_max`` keeps the reward's units: the AUC is the mean gold gain over the KL range,
comparable between algorithms at the same ``KL_max``.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "MIN_POINTS",
    "fit_run",
    "frontier_at",
    "frontier_auc",
    "gao_curve",
    "gao_fit",
    "pool_points",
    "run_frontier",
]


def _features(d: np.ndarray) -> np.ndarray:
    """Columns (d, −d log d) of the Gao form; d log d → 0 as d → 0."""
    safe = np.where(d > 0, d, 1.0)
    return np.stack([d, np.where(d > 0, -d * np.log(safe), 0.0)], axis=1)


def gao_fit(d, reward) -> tuple[float, float]:
    """Least-squares (α, β) of R(d) = d(α − β log d) through ``(d, reward)`` points.

    Raises:
        ValueError: fewer than two points with d > 0, or d < 0, or non-finite values.
    """
    d, r = np.asarray(d, dtype=np.float64), np.asarray(reward, dtype=np.float64)
    if d.shape != r.shape or not (np.isfinite(d).all() and np.isfinite(r).all()):
        raise ValueError(f"d and reward must be finite arrays of one shape, got {d.shape} and {r.shape}")
    if (d < 0).any():
        raise ValueError(f"d = sqrt(KL) must be >= 0, got min {d.min()}")
    if np.count_nonzero(d > 0) < 2:
        raise ValueError(f"the fit needs at least two points with d > 0, got {np.count_nonzero(d > 0)}")
    (alpha, beta), *_ = np.linalg.lstsq(_features(d), r, rcond=None)
    return float(alpha), float(beta)


def gao_curve(d, alpha: float, beta: float) -> np.ndarray:
    """R(d) = d(α − β log d), with R(0) = 0."""
    return _features(np.asarray(d, dtype=np.float64)) @ np.array([alpha, beta])


def frontier_at(alpha: float, beta: float, d_points, d: float) -> float:
    """F(d): the best fitted gain R(d_i) over the run's points with d_i ≤ d, and 0 (π_ref, or stopping early)."""
    pts = np.asarray(d_points, dtype=np.float64)
    reached = pts[pts <= d]
    return float(max(0.0, gao_curve(reached, alpha, beta).max(initial=0.0)))


def frontier_auc(alpha: float, beta: float, d_points, kl_max: float, points: int = 513) -> float:
    """Mean of F(√k) over the KL budget k ∈ [0, ``kl_max``] nats (a step function: the grid's trapezoids)."""
    if not kl_max > 0:
        raise ValueError(f"kl_max={kl_max} must be > 0 (nats per sequence)")
    grid = np.linspace(0.0, kl_max, points)
    values = [frontier_at(alpha, beta, d_points, math.sqrt(k)) for k in grid]
    return float(np.trapezoid(values, grid) / kl_max)


MIN_POINTS = 3  # points with d > 0 a fit needs: two parameters and one degree of freedom
_KEYS = ("kl", "score", "gold_score")  # a curve point's fields besides env_steps: the metrics rows' names


def pool_points(curve: list[dict], window: int) -> list[dict]:
    """Consecutive points merged until each covers ≥ ``window`` env steps (means weighted by their steps).

    Why: an algorithm logs its training episodes at its own grain (our agents per batch of
    episodes, SB3 per rollout, a few episodes for A2C); a point over a handful of episodes has a
    noisy KL (d = √max(KL, 0) of a near-zero noisy mean is biased up) and a noisy gold, and the
    frontier takes a maximum. Pooling to a common window gives every algorithm the same noise.
    A remainder shorter than half a window joins the last point. ``window`` 0 keeps the points.
    """
    pts = sorted((p for p in curve if all(math.isfinite(p.get(k, math.nan)) for k in _KEYS)),
                 key=lambda p: p.get("env_steps", 0))  # fmt: skip
    if window <= 0:
        return pts
    groups, current, prev = [], [], 0
    for p in pts:
        current.append((max(p["env_steps"] - prev, 1), p))
        prev = p["env_steps"]
        if sum(w for w, _ in current) >= window:
            groups.append(current)
            current = []
    if current:
        if groups and sum(w for w, _ in current) < window / 2:
            groups[-1].extend(current)
        else:
            groups.append(current)
    return [_mean_point(g) for g in groups]


def _mean_point(group: list[tuple[int, dict]]) -> dict:
    total = sum(w for w, _ in group)
    merged = {k: sum(w * p[k] for w, p in group) / total for k in _KEYS}
    return {"env_steps": group[-1][1]["env_steps"], **merged}


def fit_run(curve: list[dict], baseline: dict[str, float], key: str,
            window: int = 0) -> tuple[np.ndarray, float, float] | None:  # fmt: skip
    """(d of every point, α, β) of one run's ``key`` reward (``"gold_score"`` or ``"score"``) relative to π_ref's.

    Points without a KL or reward (NaN) are left out, the rest pooled (:func:`pool_points`); a run
    with fewer than ``MIN_POINTS`` with d > 0 has no fit (None).
    """
    pts = pool_points(curve, window)
    d = np.sqrt(np.clip([p["kl"] for p in pts], 0.0, None))
    if np.count_nonzero(d > 0) < MIN_POINTS:
        return None
    return (d, *gao_fit(d, np.array([p[key] for p in pts]) - baseline[key]))


def run_frontier(curve: list[dict], baseline: dict[str, float], kl_max: float, window: int = 0) -> dict[str, float]:
    """Fit and AUC of one run's logged ``{"kl", "score", "gold_score"}`` points, rewards taken relative to π_ref's.

    ``baseline`` holds π_ref's ``score`` and ``gold_score``; ``window`` pools the points
    (:func:`pool_points`). A run without a fit (:func:`fit_run`) gets NaN: a run that did not
    train has no frontier. ``kl_max``: the AUC's KL budget in nats. Returns ``gold_auc``,
    ``proxy_auc`` (mean gain over KL ∈ [0, kl_max]), ``gold_alpha``, ``gold_beta``, ``d_reached``.
    """
    out = {"gold_auc": math.nan, "proxy_auc": math.nan, "gold_alpha": math.nan, "gold_beta": math.nan,
           "d_reached": math.nan}  # fmt: skip
    for key, name in (("gold_score", "gold"), ("score", "proxy")):
        fit = fit_run(curve, baseline, key, window)
        if fit is None:
            return out
        d, alpha, beta = fit
        out[f"{name}_auc"] = frontier_auc(alpha, beta, d, kl_max)
        out["d_reached"] = float(d.max())
        if name == "gold":
            out["gold_alpha"], out["gold_beta"] = alpha, beta
    return out
