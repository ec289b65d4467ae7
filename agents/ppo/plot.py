"""Plot a run's learning curves (RM score, gold score, KL to π_ref) from ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["curves_figure", "plot_metrics"]


def plot_metrics(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write :func:`curves_figure` to ``run_dir/curves.png`` (or ``out``) and return its path."""
    path = Path(out) if out is not None else Path(run_dir) / "curves.png"
    curves_figure(run_dir).savefig(path, dpi=110)
    return path


def curves_figure(run_dir: str | Path) -> Figure:
    """The run's RM score, gold score and KL per iteration, each beside what it is read against.

    A curve alone says neither whether training beat its starting point nor how far the KL
    controller meant to let it go: the score panels carry π_ref's level (dotted) and the KL panel
    the controller's target (dashed; ``target_kl`` of ``run_dir/config.json``, none when β was
    fixed) and β on an axis of its own (β is a coefficient, not nats). π_ref's level is
    ``run_dir/eval.json``'s ``pi_ref`` (eval prompts) when ``textgym eval --out`` wrote it after the
    run's latest start, as ``make demo`` does, and the trained policy's evaluation is then marked
    at the last iteration; else π_ref's level is iteration 1's rollout (train prompts). Every line
    says in the legend where it comes from.
    """
    from matplotlib.figure import Figure  # not pyplot: no global backend or figure registry

    run_dir = Path(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no iterations to plot")
    config_path = run_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    ref, ref_label, final = _baselines(run_dir, rows)
    it = [r["iteration"] for r in rows]
    fig = Figure(figsize=(14, 5.2))
    axes = fig.subplots(1, 3)
    raw = config.get("normalize_reward") is False  # a run that pays the RM's raw score (the SmolLM2 preset)
    panels = (("score", "RM score (raw)" if raw else "RM score (standardised under π_ref)"),
              ("gold_score", "gold score"), ("kl", "KL(π ‖ π_ref) per sequence (nats)"))  # fmt: skip
    for ax, (key, title) in zip(axes, panels):
        ax.plot(it, [r[key] for r in rows], marker=".", label="policy: training rollouts (train prompts)")
        if key in ref and key != "kl":
            ax.axhline(ref[key], ls=":", color="gray", label=ref_label)
        if key in final:
            ax.errorbar([it[-1]], [final[key][0]], yerr=[final[key][1]], fmt="*", ms=12, color="tab:green",
                        capsize=3, label="policy: final textgym eval (eval prompts, ± std)")  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("PPO iteration")
        ax.grid(alpha=0.3)
    if config.get("target_kl") is not None:
        axes[2].axhline(config["target_kl"], ls="--", color="tab:red", label="target KL (config.json)")
    beta_ax = axes[2].twinx()  # β is a coefficient, not nats: its own scale on the right
    beta_ax.plot(it, [r["kl_coef"] for r in rows], ls="--", color="tab:purple", label="β, KL coefficient (right axis)")
    beta_ax.set_ylabel("β")
    beta_ax.set_ylim(bottom=0)
    below = {"fontsize": "small", "loc": "upper center", "bbox_to_anchor": (0.5, -0.16)}  # off the curves
    for ax in axes[:2]:
        ax.legend(**below)
    handles = [h for a in (axes[2], beta_ax) for h in a.get_legend_handles_labels()[0]]
    axes[2].legend(handles, [h.get_label() for h in handles], **below)
    fig.tight_layout()
    return fig


def _baselines(run_dir: Path, rows: list[dict]) -> tuple[dict, str, dict]:
    """π_ref's level per metric and where it comes from, and the trained policy's final evaluation.

    ``eval.json`` counts only when written after the run's latest start (``config.json``): an older
    one belongs to an earlier run in the same folder. Its entries are ``[mean, std]``.
    """
    config_path, eval_path = run_dir / "config.json", run_dir / "eval.json"
    ref, final = {}, {}
    if config_path.exists() and eval_path.exists() and eval_path.stat().st_mtime >= config_path.stat().st_mtime:
        result = json.loads(eval_path.read_text())
        pi_ref, policy = result.get("pi_ref", {}), result.get("policy", {})
        ref = {k: pi_ref[k][0] for k in ("score", "gold_score") if k in pi_ref}
        final = {k: policy[k] for k in ("score", "gold_score", "kl") if k in policy}
    if ref:
        return ref, "π_ref: textgym eval (eval.json, eval prompts)", final
    if rows[0]["iteration"] == 1:
        # Iteration 1's rollout is sampled before the first update, by the initial policy: π_ref itself.
        return rows[0], "π_ref: iteration 1's rollout (train prompts)", final
    return {}, "", final


if __name__ == "__main__":
    import sys

    print(f"wrote {plot_metrics(sys.argv[1] if len(sys.argv) > 1 else 'runs/demo')}")
