"""The benchmark harness: every adapter runs a tiny budget end to end; all outputs are written."""

import csv
import json
import math

import numpy as np
import pytest

from textgym.agents import benchmark, benchmark_report
from textgym.agents.benchmark import ALGORITHMS, BenchConfig, confidence_interval, register_algorithm, run_benchmark


def test_every_adapter_trains_and_evaluates_and_the_harness_writes_everything(tmp_path):
    cfg = BenchConfig(seeds=[0], budget=32, num_envs=8, max_new_tokens=4, eval_episodes=8, out=str(tmp_path))
    rows = run_benchmark(cfg)
    assert [r["algo"] for r in rows] == list(ALGORITHMS)
    for r in rows:
        for key in ("score", "gold_score", "kl", "objective", "distinct_2", "response_length"):
            assert math.isfinite(r[key]), (r["algo"], key)
        # every trained algorithm is charged one env step per token and stops within the budget
        if r["algo"] in ("reference", "random"):
            assert r["env_steps"] == 0
        elif r["algo"].startswith(("sb3", "maskable")):
            assert r["env_steps"] == 32, r  # whole SB3 rollouts of n_steps x n_envs that fit
        elif r["algo"] in ("grpo", "rloo"):
            assert 32 - 4 * 4 < r["env_steps"] <= 32, r  # ... in whole groups of 4
        else:
            assert 32 - 4 < r["env_steps"] <= 32, r  # the last batch shrinks to the episodes that fit
    assert next(r for r in rows if r["algo"] == "reference")["kl"] == 0.0
    with (tmp_path / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    report = (tmp_path / "results.md").read_text()
    assert "| torchrl_ppo |" in report
    assert "one seed: each cell is that run's value (no interval)" in report and "over 1 seeds" not in report
    for png in ("rm_vs_steps.png", "frontier.png"):
        assert (tmp_path / png).stat().st_size > 10_000
    # every trained algorithm logs its training episodes' gold and KL for the frontier (SB3 through a callback)
    curves = json.loads((tmp_path / "curves.json").read_text())
    for name, curve in curves.items():
        trained = not name.startswith(("reference", "random"))
        assert bool(curve) == trained, name
        assert all(math.isfinite(p["gold_score"]) and math.isfinite(p["kl"]) for p in curve), name


def test_a_user_adapter_registers_and_runs(tmp_path):
    class Greedy:
        def __init__(self, envs):
            self.envs = envs

        def reset(self):
            pass

        def act(self, obs):
            n = self.envs.num_envs
            return np.full(n, self.envs.unwrapped.eos_token_id), np.zeros(n)

    @register_algorithm("always_eos")
    def always_eos(ctx):
        ctx.log(0, 0.0)
        return Greedy

    try:
        rows = run_benchmark(BenchConfig(algos=["always_eos"], seeds=[0], budget=8, num_envs=4, eval_episodes=4,
                                         out=str(tmp_path)))  # fmt: skip
        assert rows[0]["response_length"] == 1.0
    finally:
        del ALGORITHMS["always_eos"]
    with pytest.raises(ValueError, match="not registered"):
        BenchConfig(algos=["nope"])


def test_masked_ppo_is_evaluated_with_the_masks_it_trained_with(tmp_path, monkeypatch):
    seen = {"actions": 0}
    real_evaluate = benchmark.evaluate

    def spy(policy_factory, **kwargs):
        assert kwargs["action_mask_top_p"] == 0.9

        def checked(envs):
            policy = policy_factory(envs)
            act = policy.act

            def act_in_mask(obs):
                actions, logps = act(obs)
                masks = envs.unwrapped.action_masks()
                assert not masks.all(), "top-p masks are active at evaluation"
                assert masks[np.arange(len(masks)), np.asarray(actions)].all()
                seen["actions"] += len(masks)
                return actions, logps

            policy.act = act_in_mask
            return policy

        return real_evaluate(policy_factory=checked, **kwargs)

    monkeypatch.setattr(benchmark, "evaluate", spy)
    run_benchmark(BenchConfig(algos=["maskable_ppo"], seeds=[0], budget=16, num_envs=4, max_new_tokens=4,
                              eval_episodes=4, calibration_episodes=8, out=str(tmp_path)))  # fmt: skip
    assert seen["actions"] > 0


def test_confidence_interval_on_a_known_case():
    mean, half = confidence_interval([1.0, 2.0, 3.0])  # s = 1, t_{0.975, 2} = 4.303
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    assert math.isnan(confidence_interval([5.0])[1])


def test_every_algorithm_trains_in_the_env_it_is_evaluated_in(tmp_path, monkeypatch):
    """Same objective for all: the bench's calibrated normalisation and prompt block reach every training env."""
    import gymnasium

    made = []
    for name in ("make", "make_vec"):
        real = getattr(gymnasium, name)
        monkeypatch.setattr(gymnasium, name, lambda *a, _real=real, **kw: made.append(kw) or _real(*a, **kw))
    cfg = BenchConfig(algos=["torchrl_ppo", "reinforce", "sb3_ppo"], seeds=[0], budget=16, num_envs=4,
                      max_new_tokens=4, eval_episodes=4, calibration_episodes=8, out=str(tmp_path))  # fmt: skip
    run_benchmark(cfg)
    calibration, *rest = made
    assert calibration["normalize_reward"] is False  # the calibration itself measures raw scores
    norms = {kw.get("normalize_reward") for kw in rest}
    assert len(norms) == 1 and isinstance(next(iter(norms)), tuple), norms  # one (mean, std) for every env
    assert all(kw["max_prompt_tokens"] == 16 and kw["max_new_tokens"] == 4 for kw in rest)
    assert len(rest) >= 3 + 3  # a training env per algorithm (SB3: one per sub-env) and an eval env each


def _frontier_figure(curves, monkeypatch, tmp_path):
    """The figure ``_plot_frontier`` draws (caught where it closes it) and the PNG it wrote."""
    closed, real = [], benchmark_report._pyplot()
    spy = type(
        "Spy", (), {"__getattr__": lambda self, name: getattr(real, name), "close": lambda self, f: closed.append(f)}
    )
    monkeypatch.setattr(benchmark_report, "_pyplot", spy)
    benchmark_report._plot_frontier(curves, {"score": 0.0, "gold_score": 0.0}, 2.0, 0, tmp_path, "sentiment")
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    return closed[0]


def test_an_empty_frontier_says_why_on_the_plot(tmp_path, monkeypatch):
    """Issue 26.9: at ``bench --quick``'s budget no algorithm has the points a fit needs: the panels say so."""
    few = [{"env_steps": 8 * i, "kl": 0.1 * i, "score": 0.1, "gold_score": 0.1} for i in range(1, 3)]  # 2 < MIN_POINTS
    fig = _frontier_figure({("torchrl_ppo", 0): few, ("reference", 0): []}, monkeypatch, tmp_path)
    for ax in fig.axes:
        (note,) = [t.get_text() for t in ax.texts]
        assert "No algorithm has a frontier" in note and "Raise --budget" in note
    many = [{"env_steps": 8 * i, "kl": 0.1 * i, "score": 0.1 * i, "gold_score": 0.05 * i} for i in range(1, 9)]
    fig = _frontier_figure({("torchrl_ppo", 0): many, ("grpo", 0): few, ("reference", 0): []}, monkeypatch, tmp_path)
    for ax in fig.axes:
        (note,) = [t.get_text() for t in ax.texts]  # the fitted curve is drawn; the note names the one left out
        assert " ".join(note.split()).endswith(": grpo") and "torchrl_ppo" in ax.get_legend_handles_labels()[1]


def test_the_smollm2_task_trains_in_its_preset_env_and_is_judged_on_held_out_requests(tmp_path, monkeypatch):
    """Issue 25.3: the real-model row runs SmolLM2 in smollm2-sentiment's env; its eval samples held-out requests."""
    import gymnasium

    from textgym.agents.ppo.config import PRESET_DIR, load_config_file

    preset = load_config_file(PRESET_DIR / "smollm2-sentiment.json")
    task = benchmark.TASKS["smollm2-sentiment"]
    assert {k: preset[k] for k in task.env} == task.env  # the bench and the preset train in one env
    assert task.eval_prompts == preset["eval_prompts"]
    defaults = BenchConfig(task="smollm2-sentiment")
    assert (defaults.num_envs, defaults.seeds, defaults.calibration_episodes) == (16, [0, 1], 256)

    ctx = benchmark.RunContext({**task.env, "max_new_tokens": 24, "kl_coef": 0.05}, 16, 0, 16, tmp_path, task)
    cfg = benchmark.agent_config(ctx, "grpo")  # the agents load the preset's model and keep its tuning
    assert (cfg.model, cfg.chat_template, cfg.learning_rate) == ("smollm2-135m-instruct", True, 1e-5)
    assert cfg.ppo_epochs == 2
    assert {k: getattr(cfg, k) for k in task.agent} == task.agent

    made = []
    for name in ("make", "make_vec"):
        real = getattr(gymnasium, name)
        monkeypatch.setattr(gymnasium, name, lambda *a, _real=real, **kw: made.append(kw) or _real(*a, **kw))
    cfg = BenchConfig(task="smollm2-sentiment", algos=["reference"], seeds=[0], budget=8, num_envs=2, max_new_tokens=4,
                      eval_episodes=2, calibration_episodes=2, out=str(tmp_path / "bench"))  # fmt: skip
    (row,) = run_benchmark(cfg)
    assert row["response_length"] == 4 and math.isfinite(row["score"]) and row["distinct_1"] > 0
    calibration, evaluation = made
    for kw in (calibration, evaluation):
        assert (kw["model"], kw["chat_template"], kw["reward_model"]) == ("smollm2-135m-instruct", True,
                                                                          "default-response")  # fmt: skip
    assert (calibration["prompts"], evaluation["prompts"]) == ("review-requests", "review-requests-eval")


def test_a_run_below_the_tasks_budget_is_labelled_a_smoke_run_not_results(tmp_path):
    """Issue 37.9: ``textgym bench --quick``'s table (64 env steps, one seed) read like the benchmark's results."""
    small = dict(algos=["reference"], seeds=[0], num_envs=8, max_new_tokens=4, eval_episodes=8, calibration_episodes=8)
    run_benchmark(BenchConfig(budget=64, out=str(tmp_path / "smoke"), **small))
    first = (tmp_path / "smoke" / "results.md").read_text().splitlines()[0]
    assert first.startswith("**Smoke run, not results**") and "64 env steps" in first and "8192" in first
    run_benchmark(BenchConfig(out=str(tmp_path / "full"), **small))  # the task's budget (reference trains nothing)
    assert (tmp_path / "full" / "results.md").read_text().startswith("| algorithm |")
