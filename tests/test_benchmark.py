"""The benchmark harness: every adapter runs a tiny budget end to end; all outputs are written."""

import csv
import math

import numpy as np
import pytest

from textgym.agents.benchmark import ALGORITHMS, BenchConfig, register_algorithm, run_benchmark


def test_every_adapter_trains_and_evaluates_and_the_harness_writes_everything(tmp_path):
    cfg = BenchConfig(seeds=[0], budget=32, num_envs=8, max_new_tokens=4, eval_episodes=8, out=str(tmp_path))
    rows = run_benchmark(cfg)
    assert [r["algo"] for r in rows] == list(ALGORITHMS)
    for r in rows:
        for key in ("score", "gold_score", "kl", "objective", "distinct_2", "response_length"):
            assert math.isfinite(r[key]), (r["algo"], key)
        trains = r["algo"] not in ("reference", "random")
        assert (r["env_steps"] >= 32) == trains, r
    assert next(r for r in rows if r["algo"] == "reference")["kl"] == 0.0
    with (tmp_path / "results.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert "| torchrl_ppo |" in (tmp_path / "results.md").read_text()
    for png in ("rm_vs_steps.png", "frontier.png"):
        assert (tmp_path / png).stat().st_size > 10_000


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
