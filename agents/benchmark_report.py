"""A benchmark's report: its tables (mean ± 95 % CI over seeds), learning-curve and frontier plots, frontier table.

Everything here reads rows and curves a benchmark wrote (:mod:`textgym.agents.benchmark`) and trains nothing,
so a finished benchmark's report can be rebuilt from its own files (``refit``).
"""

from __future__ import annotations

import csv
import json
import math
import textwrap
from pathlib import Path

import numpy as np

from .frontier import MIN_POINTS, fit_run, frontier_at, gao_curve, gao_fit, pool_points

__all__ = ["FRONTIER_EPISODES", "confidence_interval", "frontier_window", "write_frontier_table", "write_outputs"]


FRONTIER_EPISODES = 64  # each frontier point pools at least this many episodes at the length cap


def frontier_window(max_new_tokens: int) -> int:
    """Env steps each frontier point pools: ``FRONTIER_EPISODES`` episodes at the length cap."""
    return FRONTIER_EPISODES * max_new_tokens


def write_outputs(rows: list[dict], curves: dict, out: Path, cfg, baseline: dict, env_id: str) -> None:
    """``results.csv``/``.md``, the curves and frontier plots and ``frontier.md`` of a benchmark (``cfg``: its
    :class:`textgym.agents.benchmark.BenchConfig`)."""
    _write_tables(rows, out, cfg, env_id)
    _plot_curves(curves, out)
    _plot_frontier(curves, baseline, math.sqrt(cfg.frontier_kl), frontier_window(cfg.max_new_tokens), out, cfg.task)
    write_frontier_table(out)


def write_frontier_table(out: str | Path, fractions: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)) -> str:
    """``OUT/frontier.md`` from ``curves.json`` and ``env.json``: who leads at which KL.

    For each algorithm and KL budget k (fractions of ``frontier_kl``): the frontier F(√k) of its
    Gao fit on pooled points (``frontier_window``) — the best gold gain over π_ref it reached within
    KL k — as mean ± 95 % CI over seeds.
    Returns the table (it can be rebuilt from a finished benchmark's files).
    """
    out = Path(out)
    curves = json.loads((out / "curves.json").read_text())
    setup = json.loads((out / "env.json").read_text())
    budgets = [setup["frontier_kl"] * f for f in fractions]
    lines = ["| algorithm | " + " | ".join(f"gold gain at KL ≤ {k:g}" for k in budgets) + " |",
             "|---" * (len(budgets) + 1) + "|"]  # fmt: skip
    window = setup.get("frontier_window", 0)
    for algo in dict.fromkeys(name.split("/")[0] for name in curves):
        runs = [c for name, c in curves.items() if name.split("/")[0] == algo]
        fits = [fit_run(c, setup["reference"], "gold_score", window) for c in runs]
        fits = [f for f in fits if f is not None]
        if fits:
            cells = [_cell([frontier_at(alpha, beta, d, math.sqrt(k)) for d, alpha, beta in fits]) for k in budgets]
            lines.append(f"| {algo} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (out / "frontier.md").write_text(table)
    return table


# Two-sided 95 % Student-t quantiles t_{0.975, df}; beyond the table the normal 1.96 is within 2 %.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
         2.042]  # fmt: skip


def confidence_interval(values) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (Student t, n − 1 degrees of freedom).

    One value has no interval: its half-width is NaN.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return float(v.mean()), math.nan
    t = _T975[v.size - 2] if v.size - 1 <= len(_T975) else 1.96
    return float(v.mean()), float(t * v.std(ddof=1) / math.sqrt(v.size))


def _write_tables(rows: list[dict], out: Path, cfg, env_id: str) -> None:
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    keys = ["score", "gold_score", "kl", "objective", "gold_auc", "proxy_auc", "distinct_2", "response_length",
            "env_steps", "train_s"]  # fmt: skip
    lines = [smoke_note(cfg) + "\n"] if smoke_note(cfg) else []
    lines += ["| algorithm | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for algo in dict.fromkeys(r["algo"] for r in rows):
        lines.append(f"| {algo} | " + " | ".join(_cell([r[k] for r in rows if r["algo"] == algo]) for k in keys) + " |")
    n_seeds = len({r["seed"] for r in rows})
    spread = (f"mean ± half-width of the 95 % confidence interval (Student t) over {n_seeds} seeds" if n_seeds > 1
              else "one seed: each cell is that run's value (no interval)")  # fmt: skip
    lines.append(f"\n{cfg.task} ({env_id}), budget {cfg.budget} env steps, β {cfg.kl_coef}: {spread}; "
                 f"score, gold, KL and objective on {cfg.eval_episodes} eval episodes; gold_auc/proxy_auc: "
                 f"mean gain over π_ref under the fitted frontier, averaged over KL ∈ [0, {cfg.frontier_kl:g}] nats "
                 f"(agents/frontier.py)")  # fmt: skip
    (out / "results.md").write_text("\n".join(lines) + "\n")


def smoke_note(cfg) -> str | None:
    """The label of a run below its task's budget (``textgym bench --quick``), None for a run at it.

    Why: a smoke run's table has the shape of the benchmark's results; read as results, its numbers
    (a few dozen env steps, one seed) would mislead.
    """
    if cfg.budget >= cfg.task_budget:
        return None
    return (f"**Smoke run, not results**: {cfg.budget} env steps per algorithm, below the {cfg.task} task's "
            f"{cfg.task_budget}; this table shows that each algorithm runs end to end, not how well it learns "
            "(the measured benchmarks: docs/benchmarks.md).")  # fmt: skip


def _cell(values: list[float]) -> str:
    """``mean ± half-width`` over the finite values; ``–`` when there are none (e.g. no frontier)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "–"
    mean, half = confidence_interval(finite)
    return f"{mean:.3f}" if math.isnan(half) else f"{mean:.3f} ± {half:.3f}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_curves(curves: dict, out: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for algo in dict.fromkeys(a for a, _ in curves):
        runs = [c for (a, _), c in curves.items() if a == algo and c]
        if not runs:
            continue
        grid = np.linspace(0, max(c[-1]["env_steps"] for c in runs), 30)
        ys = np.array([np.interp(grid, [p["env_steps"] for p in c], [p["score"] for p in c]) for c in runs])
        ax.plot(grid, ys.mean(0), label=algo)
        ax.fill_between(grid, ys.mean(0) - ys.std(0), ys.mean(0) + ys.std(0), alpha=0.2)
    ax.set_xlabel("env steps (tokens)")
    ax.set_ylabel("RM score (as the env pays it) of training episodes")
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=8)
    else:  # only algorithms that do not train (reference): an empty frame would look like a failed plot
        ax.text(0.5, 0.5, "no training curves: every algorithm in this run\nsamples a fixed policy (reference)",
                ha="center", va="center", transform=ax.transAxes)  # fmt: skip
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "rm_vs_steps.png", dpi=110)
    plt.close(fig)


def _note_unfitted(ax, unfitted: list[str], fitted: bool, window: int) -> None:
    """Say on the panel which algorithms have no fitted curve and why, rather than leave the frame empty."""
    if not unfitted:
        return
    why = f"fewer than {MIN_POINTS} training points with KL > 0 (each pooled over {window} env steps)"
    box = {"facecolor": "white", "alpha": 0.8, "edgecolor": "none"}
    if fitted:
        text = textwrap.fill(f"no fit, {why}: {', '.join(unfitted)}", 60)
        ax.text(0.01, 0.01, text, transform=ax.transAxes, fontsize=7, va="bottom", bbox=box)
    else:
        text = "\n".join(["No algorithm has a frontier to draw:", textwrap.fill(why + ",", 40),
                          "too small a budget for a fit.", "Raise --budget (textgym bench)."])  # fmt: skip
        ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=9, bbox=box)


def _frontier_points(curves: dict, algo: str, baseline: dict, key: str, window: int) -> tuple[np.ndarray, np.ndarray]:
    """All seeds' pooled training points of ``algo``: d = √KL and the ``key`` reward gained over π_ref."""
    pts = [p for (a, _), c in curves.items() if a == algo for p in pool_points(c, window)]
    d = np.sqrt(np.clip([p["kl"] for p in pts], 0.0, None))
    return d, np.array([p[key] for p in pts]) - baseline[key]


def _plot_frontier(curves: dict, baseline: dict, d_max: float, window: int, out: Path, task: str) -> None:
    """Proxy and gold gain against √KL: the raw and the pooled training points, the Gao fit over all seeds, π_ref."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key, title in ((axes[0], "score", "proxy (RM score) − π_ref's"), (axes[1], "gold_score", "gold − π_ref's")):
        unfitted: list[str] = []
        for i, algo in enumerate(dict.fromkeys(a for a, _ in curves)):
            d, r = _frontier_points(curves, algo, baseline, key, window)
            if np.count_nonzero(d > 0) < MIN_POINTS:
                unfitted += [algo] if len(d) else []  # an untrained baseline has no points to fit
                continue
            color = colors[i % len(colors)]
            raw_d, raw_r = _frontier_points(curves, algo, baseline, key, 0)  # unpooled: what the fit smooths
            ax.scatter(raw_d, raw_r, s=3, alpha=0.25, color=color, marker=".")
            ax.scatter(d, r, s=10, alpha=0.6, color=color)
            grid = np.linspace(0, d.max(), 100)
            ax.plot(grid, gao_curve(grid, *gao_fit(d, r)), color=color, label=algo)
        ax.scatter([0], [0], marker="*", s=120, color="black", label="π_ref", zorder=5)
        ax.axvline(d_max, color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel("d = √KL(π ‖ π_ref) (√nats per sequence), training episodes")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        fitted = any(label != "π_ref" for label in ax.get_legend_handles_labels()[1])
        _note_unfitted(ax, unfitted, fitted, window)
    axes[0].legend(fontsize=8)
    # two lines: a task name as long as smollm2-sentiment pushed one line past both edges
    fig.suptitle(f"{task}: reward–KL frontier, fits R(d) = d(α − β log d) (Gao et al. 2022)\nsmall dots: raw "
                 "points, large: pooled; dotted: AUC limit", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)
