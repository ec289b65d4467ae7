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
    fixed). π_ref's level is ``run_dir/eval.json``'s ``pi_ref`` (eval prompts) when ``textgym eval
    --out`` wrote it after the run's latest start, as ``make demo`` does; else iteration 1's rollout.
    """
    from matplotlib.figure import Figure  # not pyplot: no global backend or figure registry

    run_dir = Path(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no iterations to plot")
    config_path, eval_path = run_dir / "config.json", run_dir / "eval.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    ref, ref_label = {}, ""
    if config and eval_path.exists() and eval_path.stat().st_mtime >= config_path.stat().st_mtime:
        pi_ref = json.loads(eval_path.read_text()).get("pi_ref", {})  # key: [mean, std]
        ref = {k: pi_ref[k][0] for k in ("score", "gold_score") if k in pi_ref}
        ref_label = "π_ref (eval.json, eval prompts)"
    if not ref and rows[0]["iteration"] == 1:
        # Iteration 1's rollout is sampled before the first update, by the initial policy: π_ref itself.
        ref, ref_label = rows[0], "π_ref (iteration 1's rollout)"
    it = [r["iteration"] for r in rows]
    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    panels = (("score", "RM score (normalised under π_ref)"), ("gold_score", "gold score (VADER)"),
              ("kl", "KL(π ‖ π_ref) per sequence (nats)"))  # fmt: skip
    for ax, (key, title) in zip(axes, panels):
        ax.plot(it, [r[key] for r in rows], marker=".")
        if key in ref and key != "kl":
            ax.axhline(ref[key], ls=":", color="gray", label=ref_label)
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("PPO iteration")
        ax.grid(alpha=0.3)
    axes[2].plot(it, [r["beta"] * 100 for r in rows], ls="--", label="β × 100")
    if config.get("target_kl") is not None:
        axes[2].axhline(config["target_kl"], ls="--", color="tab:red", label="target KL")
    axes[2].legend()
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    import sys

    print(f"wrote {plot_metrics(sys.argv[1] if len(sys.argv) > 1 else 'runs/demo')}")
