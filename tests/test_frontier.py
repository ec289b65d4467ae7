"""The reward–KL frontier (Gao et al. 2022): the fit, its area, and a benchmark run on the arithmetic task."""

import csv
import json
import math

import numpy as np
import pytest

from textgym.agents.frontier import frontier_at, frontier_auc, gao_curve, gao_fit, run_frontier


def test_the_fit_recovers_alpha_and_beta_from_points_on_a_gao_curve():
    d = np.array([0.0, 0.3, 0.7, 1.0, 1.6, 2.5])
    alpha, beta = gao_fit(d, d * (0.8 - 0.3 * np.log(np.where(d > 0, d, 1.0))))
    assert (alpha, beta) == pytest.approx((0.8, 0.3), abs=1e-12)
    assert gao_curve([0.0], alpha, beta)[0] == 0.0


def test_the_area_of_a_rising_then_falling_frontier_on_a_hand_computed_case():
    # R(d) = d(1 − ln d) peaks at d = 1 with R = 1 and is 0 again at d = e. With points everywhere the frontier is
    # R up to d = 1, then 1 (a policy can stop at the peak). Averaged over KL k = d² ∈ [0, e²] nats:
    # ∫0^1 R(√k) dk = ∫0^1 2d²(1 − ln d) dd = 2(1/3 + 1/9) = 8/9, then 1 on [1, e²]: mean (8/9 + e² − 1)/e².
    dense = np.linspace(0, 10, 20001)
    e2 = math.e**2
    assert frontier_auc(1.0, 1.0, dense, kl_max=e2, points=4001) == pytest.approx((8 / 9 + e2 - 1) / e2, abs=1e-3)
    # no credit past the KL a run reached: R(d) = d reached only up to d = 1 (KL 1), held there up to KL 4:
    # ∫0^1 √k dk = 2/3, then 1 on [1, 4]: mean (2/3 + 3)/4 (over √KL it would have been 3/4)
    reached = np.linspace(0, 1, 20001)
    assert frontier_auc(1.0, 0.0, reached, kl_max=4.0, points=4001) == pytest.approx(11 / 12, abs=1e-3)
    # a run that only lost reward has the frontier of π_ref itself
    assert frontier_auc(-1.0, 0.0, dense, kl_max=4.0) == 0.0
    with pytest.raises(ValueError, match="kl_max=0 must be > 0"):
        frontier_auc(1.0, 0.0, dense, kl_max=0)


def test_the_fit_is_read_only_at_the_kls_a_run_reached():
    # points at d = 0.5 and 1 of R(d) = d: F is a step function, 0 then 0.5 then 1
    assert [frontier_at(1.0, 0.0, [0.5, 1.0], d) for d in (0.4, 0.5, 0.9, 1.0, 5.0)] == [0.0, 0.5, 0.5, 1.0, 1.0]
    # a curve that rises and falls between two points earns nothing for its unmeasured peak
    assert frontier_at(-104.0, 71.0, [2.6e-4, 0.226], 1.0) < 0.5 < 5 < float(gao_curve([0.085], -104.0, 71.0)[0])


def test_a_run_is_fitted_relative_to_pi_ref_and_points_without_kl_are_left_out():
    d = np.array([0.0, 0.5, 1.0, 1.5])
    curve = [{"env_steps": i, "kl": float(x * x), "score": 2.0 + 3 * x, "gold_score": 0.5 + x} for i, x in enumerate(d)]
    curve.append({"env_steps": 9, "kl": math.nan, "score": 100.0, "gold_score": 100.0})  # ctx.log(steps, score)
    out = run_frontier(curve, {"score": 2.0, "gold_score": 0.5}, kl_max=1.0)
    assert out["gold_alpha"] == pytest.approx(1.0) and out["gold_beta"] == pytest.approx(0.0, abs=1e-12)
    # F over KL k: 0 on [0, 0.25), 0.5 on [0.25, 1), 1 at 1 (gold): mean 0.375; three times that (proxy)
    assert out["gold_auc"] == pytest.approx(0.375, abs=2e-3) and out["proxy_auc"] == pytest.approx(1.125, abs=6e-3)
    assert out["d_reached"] == 1.5
    no_fit = run_frontier(curve[:3], {"score": 0.0, "gold_score": 0.0}, kl_max=1.0)  # 2 points: no fit
    assert math.isnan(no_fit["gold_auc"])


def test_the_fit_refuses_too_few_points_and_negative_d():
    with pytest.raises(ValueError, match="at least two points"):
        gao_fit([0.0, 1.0], [0.0, 1.0])
    with pytest.raises(ValueError, match="must be >= 0"):
        gao_fit([-1.0, 1.0, 2.0], [0.0, 1.0, 1.0])


def test_bench_on_the_arithmetic_task_fits_a_frontier_from_the_cli(tmp_path):
    from textgym.cli import main

    main(["bench", "--task", "arithmetic", "--algos", "grpo,reference", "--seeds", "0", "--budget", "2048",
          "--num-envs", "8", "--eval-episodes", "8", "--out", str(tmp_path)])  # fmt: skip
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["env_id"] == "TextArithmetic-v0" and env["normalize_reward"] is False
    assert 0.2 < env["reference"]["gold_score"] < 0.8  # π_ref's exact-answer rate, the frontier's origin
    with (tmp_path / "results.csv").open() as f:
        rows = {r["algo"]: r for r in csv.DictReader(f)}
    grpo = rows["grpo"]
    assert math.isfinite(float(grpo["gold_auc"])) and float(grpo["d_reached"]) > 0
    assert grpo["gold_auc"] == grpo["proxy_auc"]  # the verifier is both reward and gold here
    assert rows["reference"]["gold_auc"] == "nan"  # it did not train: no frontier, not a zero
    assert "gold_auc" in (tmp_path / "results.md").read_text()


def test_the_frontier_at_a_kl_budget_and_the_table_of_who_leads_where(tmp_path):
    from textgym.agents.benchmark import write_frontier_table

    # "slow" gains 0.5·d up to d = 2 (KL 4); "fast" gains d but stops at d = 1 (KL 1)
    curve = lambda slope, reach: [{"kl": d * d, "score": 0.0, "gold_score": 0.1 + slope * d}  # noqa: E731
                                  for d in np.linspace(0, reach, 5)]  # fmt: skip
    curves = {f"{a}/{s}": curve(slope, reach) for a, slope, reach in (("slow", 0.5, 2.0), ("fast", 1.0, 1.0))
              for s in (0, 1)}  # fmt: skip
    (tmp_path / "curves.json").write_text(json.dumps(curves))
    (tmp_path / "env.json").write_text(json.dumps({"frontier_kl": 4.0, "reference": {"score": 0.0, "gold_score": 0.1}}))
    rows = {line.split("|")[1].strip(): line for line in write_frontier_table(tmp_path).splitlines()[2:]}
    cells = lambda algo: [float(c.split("±")[0]) for c in rows[algo].split("|")[2:-1]]  # noqa: E731
    # KL 0.5, 1, 2, 4: the fits read at the points reached (fast: d = 0.25 ... 1, slow: d = 0.5 ... 2)
    assert cells("fast") == pytest.approx([0.5, 1.0, 1.0, 1.0], abs=1e-3)
    assert cells("slow") == pytest.approx([0.25, 0.5, 0.5, 1.0], abs=1e-3)
    assert (tmp_path / "frontier.md").read_text().startswith("| algorithm | gold gain at KL ≤ 0.5 |")


def test_refit_recomputes_a_finished_benchmarks_frontier_from_its_files(tmp_path):
    from textgym.agents.benchmark import BenchConfig, refit, run_benchmark
    from textgym.cli import main

    run_benchmark(BenchConfig(task="arithmetic", algos=["grpo"], seeds=[0, 1], budget=2048, num_envs=8,
                              eval_episodes=8, calibration_episodes=32, out=str(tmp_path)))  # fmt: skip
    before = (tmp_path / "results.csv").read_text()
    for name in ("curves.json", "env.json"):  # as a benchmark written before the curves said gold_score
        path = tmp_path / name
        path.write_text(path.read_text().replace('"gold_score"', '"gold"'))
    assert refit(tmp_path)[0]["gold_auc"] == float(next(csv.DictReader(before.splitlines()))["gold_auc"])
    assert '"gold"' not in (tmp_path / "curves.json").read_text() + (tmp_path / "env.json").read_text()
    main(["bench", "--refit", str(tmp_path), "--frontier-kl", "0.25"])
    curves = json.loads((tmp_path / "curves.json").read_text())
    setup = json.loads((tmp_path / "env.json").read_text())
    with (tmp_path / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        fit = run_frontier(curves[f"grpo/{row['seed']}"], setup["reference"], 0.25, setup["frontier_window"])
        expected = fit["gold_auc"]
        assert float(row["gold_auc"]) == pytest.approx(expected, abs=1e-4)
    assert setup["frontier_kl"] == 0.25 and "KL ≤ 0.25 |" in (tmp_path / "frontier.md").read_text()
    assert float(rows[0]["score"]) == float(next(csv.DictReader(before.splitlines()))["score"])  # eval untouched


def test_points_are_pooled_to_a_common_window_of_env_steps_weighted_by_their_steps():
    from textgym.agents.frontier import pool_points

    rows = ((10, 0.0, 1.0), (30, 1.0, 0.0), (40, 2.0, 1.0), (45, 4.0, 0.0), (70, 0.5, 0.5))
    curve = [{"env_steps": s, "kl": kl, "score": 0.0, "gold_score": g} for s, kl, g in rows]
    pooled = pool_points(curve, window=30)
    # [10 + 20 steps] then [10 + 5 + 25]: weights are the steps each point covers
    assert [p["env_steps"] for p in pooled] == [30, 70]
    assert pooled[0]["kl"] == pytest.approx((10 * 0.0 + 20 * 1.0) / 30)
    assert pooled[0]["gold_score"] == pytest.approx(1 / 3)
    assert pooled[1]["kl"] == pytest.approx((10 * 2.0 + 5 * 4.0 + 25 * 0.5) / 40)
    assert pool_points(curve, window=0) == curve  # no pooling
    assert len(pool_points(curve, window=65)) == 1  # a remainder under half a window joins the last point
