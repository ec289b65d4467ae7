"""Plot a run's learning curves (RM score, gold score, KL to π_ref) from ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["plot_metrics"]


def plot_metrics(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``run_dir/curves.png`` (or ``out``) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no iterations to plot")
    it = [r["iteration"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = (("score", "RM score (normalised under π_ref)"), ("gold_score", "gold score (VADER)"),
              ("kl", "KL(π ‖ π_ref) per sequence (nats)"))  # fmt: skip
    for ax, (key, title) in zip(axes, panels):
        ax.plot(it, [r[key] for r in rows], marker=".")
        ax.set_title(title)
        ax.set_xlabel("PPO iteration")
        ax.grid(alpha=0.3)
    axes[2].plot(it, [r["beta"] * 100 for r in rows], ls="--", label="β × 100")
    axes[2].legend()
    fig.tight_layout()
    path = Path(out) if out is not None else run_dir / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    import sys

    print(f"wrote {plot_metrics(sys.argv[1] if len(sys.argv) > 1 else 'runs/demo')}")
