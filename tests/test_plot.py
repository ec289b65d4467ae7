"""The demo plot: its curves, the KL target line and the π_ref baseline (from a hand-written run folder)."""

import json
import os

import pytest

from textgym.agents.ppo.plot import curves_figure, plot_metrics

ROWS = [{"iteration": i, "score": s, "gold_score": g, "kl": k, "kl_coef": 0.1}
        for i, s, g, k in ((1, -0.25, 0.3, 0.0), (2, 0.5, 0.6, 2.0), (3, 1.0, 0.8, 4.0))]  # fmt: skip


def write_run(path, target_kl, rows=ROWS, eval_pi_ref=None):
    path.mkdir(exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.json").write_text(json.dumps({"target_kl": target_kl, "kl_coef": 0.1}))
    if eval_pi_ref is not None:
        (path / "eval.json").write_text(json.dumps({"pi_ref": eval_pi_ref, "policy": eval_pi_ref}))
    return path


def lines(ax):
    """{label: y data} of the lines drawn on ``ax``."""
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}


TRAINING = "policy: training rollouts (train prompts)"
FIRST = "π_ref: iteration 1's rollout (train prompts)"
EVAL = "π_ref: textgym eval (eval.json, eval prompts)"
BETA = "β, KL coefficient (right axis)"


def legend(ax):
    return [text.get_text() for text in ax.get_legend().get_texts()]


def test_kl_panel_draws_the_target_and_score_panels_iteration_1_as_pi_ref(tmp_path):
    score, gold, kl, beta = curves_figure(write_run(tmp_path, target_kl=6.0)).axes
    assert lines(kl)["target KL (config.json)"] == [6.0, 6.0]
    assert lines(beta)[BETA] == pytest.approx([0.1] * 3)
    assert lines(score)[FIRST] == [-0.25, -0.25]  # the first row, drawn flat
    assert lines(gold)[FIRST] == [0.3, 0.3]
    assert legend(score) == [TRAINING, FIRST]


def test_every_line_has_a_legend_entry_beta_its_own_axis_and_the_final_eval_a_mark(tmp_path):
    """Issue 26.8: the demo plot's training lines had no legend entry, β × 100 shared the KL axis in
    nats, and the final evaluation (eval.json's policy) was not drawn."""
    pi_ref = {"score": [-0.09, 1.08], "gold_score": [0.27, 0.48], "kl": [0.0, 0.0]}
    run = write_run(tmp_path, target_kl=6.0, eval_pi_ref=pi_ref)
    (run / "eval.json").write_text(json.dumps({"pi_ref": pi_ref, "policy": {"score": [1.5, 0.3],
                                   "gold_score": [0.9, 0.1], "kl": [6.3, 3.2]}}))  # fmt: skip
    score, gold, kl, beta = curves_figure(run).axes
    final = "policy: final textgym eval (eval prompts, ± std)"
    assert legend(score) == [TRAINING, EVAL, final] and legend(gold) == [TRAINING, EVAL, final]
    assert sorted(legend(kl)) == sorted([TRAINING, final, "target KL (config.json)", BETA])  # β's entry joins in
    assert BETA not in lines(kl) and beta.get_shared_x_axes().joined(beta, kl)  # own y axis, same iterations
    marks = {ax: [c for c in ax.containers if c.get_label() == final] for ax in (score, gold, kl)}
    for ax, want in ((score, 1.5), (gold, 0.9), (kl, 6.3)):
        (point,) = marks[ax]
        assert list(point.lines[0].get_xdata()) == [3] and list(point.lines[0].get_ydata()) == [want]


def test_fixed_beta_has_no_target_line(tmp_path):
    kl = curves_figure(write_run(tmp_path, target_kl=None)).axes[2]
    assert list(lines(kl)) == [TRAINING]  # the KL curve alone; β is on its own axis


def test_pi_ref_from_eval_json_when_written_after_the_run_started(tmp_path):
    pi_ref = {"score": [-0.09, 1.08], "gold_score": [0.27, 0.48], "kl": [0.0, 0.0]}
    run = write_run(tmp_path, target_kl=6.0, eval_pi_ref=pi_ref)
    score, gold, kl, _ = curves_figure(run).axes
    assert lines(score)[EVAL] == [-0.09, -0.09]
    assert lines(gold)[EVAL] == [0.27, 0.27]
    assert not any(label.startswith("π_ref") for label in lines(kl))

    # an eval.json older than the run's config.json belongs to an earlier run: iteration 1 is used
    config_time = os.stat(run / "config.json").st_mtime
    os.utime(run / "eval.json", (config_time - 60, config_time - 60))
    assert FIRST in lines(curves_figure(run).axes[0])


def test_no_pi_ref_line_without_iteration_1(tmp_path):
    score = curves_figure(write_run(tmp_path, target_kl=6.0, rows=ROWS[1:])).axes[0]
    assert list(lines(score)) == [TRAINING]


def test_plot_metrics_writes_the_png_and_refuses_an_empty_run(tmp_path):
    path = plot_metrics(write_run(tmp_path / "run", target_kl=6.0), out=tmp_path / "c.png")
    assert path == tmp_path / "c.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_metrics(tmp_path / "run") == tmp_path / "run" / "curves.png"
    with pytest.raises(ValueError, match="metrics.jsonl holds no iterations"):
        plot_metrics(write_run(tmp_path / "empty", target_kl=6.0, rows=[]))


def test_the_score_panel_says_whether_the_run_paid_the_raw_rm_score(tmp_path):
    """The SmolLM2 preset pays the raw RM score (normalize_reward false): its panel said "normalised"."""
    run = write_run(tmp_path / "standardised", target_kl=None)
    assert curves_figure(run).axes[0].get_title() == "RM score (standardised under π_ref)"
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "normalize_reward": False}))
    assert curves_figure(run).axes[0].get_title() == "RM score (raw)"
