"""A run's numbers depend on its config and seed, never on how busy the machine is (the thread count is
a recorded run setting), and a resume continues with the run's own thread count."""

import json
import os
import subprocess
import sys

import pytest
import torch

from textgym.agents.benchmark import BenchConfig, run_benchmark
from textgym.agents.ppo import PPOConfig, train
from textgym.agents.ppo.config import PRESETS
from textgym.threads import machine_threads, use_threads

TIMING = ("tokens_per_s", "time_rollout", "time_policy_sampling", "time_advantage", "time_update")


def _cli_train(out, *flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-m", "textgym.cli", "train", "--config", "tiny", "--total-episodes", "32",
                           "--out", str(out), *flags], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


@pytest.mark.skipif(machine_threads() < 2, reason="needs 2 cores: one busy, one for the run")
def test_a_run_repeats_itself_exactly_while_another_process_keeps_a_core_busy(tmp_path):
    """Before, the CLI took one thread per *idle* core: the busy run used 1 thread and differed from iteration 2."""
    quiet = _cli_train(tmp_path / "quiet")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        loaded = _cli_train(tmp_path / "busy")
    finally:
        busy.kill()
        busy.wait()
    assert len(quiet) == 4 and quiet == loaded
    recorded = json.loads((tmp_path / "busy" / "config.json").read_text())["threads"]
    assert recorded == machine_threads()  # the CLI imports textgym before torch: its passive wait, every core


def _tiny(tmp_path, **changes) -> PPOConfig:
    return PPOConfig(**{**PRESETS["tiny"], "out": str(tmp_path / "run"), **changes})


IMPORT_THREADS = "import torch, sys; {before}; import textgym; print(torch.get_num_threads())"


def _threads_after_import(before: str = "pass", **env: str) -> int:
    """torch's thread count in a fresh ``python -c`` after ``import textgym`` (``before`` runs first)."""
    clean = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = IMPORT_THREADS.format(before=before)
    done = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          check=True)  # fmt: skip
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(machine_threads() < 2, reason="on one core there is no core to leave free")
def test_import_leaves_a_core_free_unless_the_user_chose_a_count():
    """Imported after torch (libgomp's wait fixed): torch's default (a thread per core) made the README's snippets
    2.6-3.8x slower beside one busy core of two, so one core is left free."""
    assert _threads_after_import() == machine_threads() - 1
    assert _threads_after_import("torch.set_num_threads(1)") == 1  # a lower count set before the import is kept
    assert _threads_after_import(OMP_NUM_THREADS=str(machine_threads())) == machine_threads()  # the user's choice


FIRST = "import os, textgym, torch; print(torch.get_num_threads(), os.environ.get('OMP_WAIT_POLICY'))"


def _first_import(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", FIRST], env={**clean, **env}, capture_output=True, text=True,
                          check=True)  # fmt: skip
    return done.stdout.split()[-2:]


def test_import_before_torch_sets_a_passive_wait_and_every_core_unless_the_user_chose():
    """Issue 35.2: a dedicated run (the CLI, a script importing textgym first) on every core, OpenMP's passive wait
    set before torch loads so that a busy core costs little (docs/performance.md, "Threads")."""
    from textgym.threads import WAIT_POLICY

    assert _first_import() == [str(machine_threads()), WAIT_POLICY]
    assert _first_import(OMP_WAIT_POLICY="ACTIVE") == [str(machine_threads()), "ACTIVE"]  # the user's policy is kept
    assert _first_import(GOMP_SPINCOUNT="50") == [str(machine_threads()), "None"]  # and the user's spin
    assert _first_import(OMP_NUM_THREADS="1") == ["1", WAIT_POLICY]


def test_resume_reuses_the_recorded_thread_count_and_refuses_another(tmp_path):
    before = torch.get_num_threads()
    whole = train(_tiny(tmp_path / "whole", total_episodes=32, threads=1))
    assert torch.get_num_threads() == before  # the caller's count is given back
    train(_tiny(tmp_path, total_episodes=16, threads=1))
    cfg = _tiny(tmp_path, total_episodes=32, resume=True)  # threads not given: the run's own
    with pytest.warns(UserWarning, match="total_episodes changes"):
        resumed = train(cfg)
    assert cfg.threads == 1
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in resumed] == [
        {k: v for k, v in r.items() if k not in TIMING} for r in whole
    ]
    with pytest.raises(ValueError, match=r"threads: 1 -> 2"):
        train(_tiny(tmp_path, total_episodes=48, resume=True, threads=2))


def test_thread_settings_are_checked():
    with pytest.raises(ValueError, match=r"threads=0 must be an int >= 1 or None"):
        PPOConfig(threads=0)
    with pytest.raises(ValueError, match=r"threads='2' must be an int >= 1 or None"):
        use_threads("2")


def test_two_benchmark_invocations_give_identical_tables(tmp_path):
    def table(out):
        cfg = BenchConfig(algos=["reference", "torchrl_ppo", "grpo"], seeds=[0], budget=48, num_envs=8,
                          max_new_tokens=4, eval_episodes=8, calibration_episodes=16, out=str(out),
                          threads=2)  # fmt: skip
        rows = run_benchmark(cfg)
        assert json.loads((out / "env.json").read_text())["threads"] == 2
        return [{k: v for k, v in r.items() if k not in ("train_s", "env_steps_per_s")} for r in rows]

    assert json.dumps(table(tmp_path / "a")) == json.dumps(table(tmp_path / "b"))  # NaN cells (π_ref's AUC) too


def test_omp_num_threads_set_by_the_user_is_the_default_and_deterministic_mode_is_given_back(tmp_path, monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 per rank: a run without --threads takes it rather than one per core."""
    from textgym.agents.ppo.trainer import Trainer

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    modes = []
    iteration = Trainer.iteration

    def spy(self, *args, **kwargs):
        modes.append(torch.are_deterministic_algorithms_enabled())
        return iteration(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "iteration", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # what torch read from OMP_NUM_THREADS at import
    try:
        cfg = _tiny(tmp_path, total_episodes=8, deterministic=True)
        train(cfg)
    finally:
        torch.set_num_threads(before)
    assert cfg.threads == 1 and json.loads((tmp_path / "run" / "config.json").read_text())["threads"] == 1
    assert modes and all(modes)  # --deterministic: torch's deterministic algorithms during every iteration
    assert not torch.are_deterministic_algorithms_enabled()  # the caller's mode, given back


def test_a_run_saved_before_tis_cap_existed_resumes_only_without_weights():
    from textgym.agents.ppo.run_folder import check_resume_config

    saved = {k: v for k, v in _tiny_dict().items() if k != "tis_cap"}
    with pytest.raises(ValueError, match=r"tis_cap: None -> 2.0"):
        check_resume_config(saved, PPOConfig(**_tiny_dict()))
    check_resume_config(saved, PPOConfig(**{**_tiny_dict(), "tis_cap": None}))


def _tiny_dict() -> dict:
    return PPOConfig(**{**PRESETS["tiny"], "out": "runs/x"}).to_dict()
