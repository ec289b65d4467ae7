"""Rollout workers on Ray: the same run for the same seed and K, whatever happens to a worker; exact resume.

One local 2-CPU Ray cluster serves the module (started and stopped here); each run's two workers
take one CPU each, so every trainer is closed before the next one starts.
"""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from textgym.agents.ppo import PPOConfig, Trainer, train
from textgym.agents.ppo.config import PRESETS

ray = pytest.importorskip("ray")

# the numbers of a row (times differ from run to run)
METRICS = ("episodes", "env_steps", "rm_score", "score", "gold_score", "kl", "kl_coef", "response_length",
           "explained_variance", "logprob_mismatch_max", "policy_loss", "value_loss", "approx_kl",
           "entropy")  # fmt: skip


def tiny(tmp_path, **changes) -> PPOConfig:
    """8 slots over 2 workers, 8 tokens, fp32 and one learner thread (exact comparisons: train() and a bare
    Trainer.create must update with the same thread count, whose rounding the numbers depend on)."""
    base = {"max_new_tokens": 8, "num_workers": 2, "precision": "fp32", "total_episodes": 24, "threads": 1}
    return PPOConfig(**{**PRESETS["tiny"], **base, "out": str(tmp_path / "run"), **changes})


def numbers(row):
    return {k: row[k] for k in METRICS if k in row}


OBJECT_STORE = 128 * 2**20  # the runs here move tiny weights: Ray's default reserves 30 % of the machine's memory


@pytest.fixture(scope="module")
def cluster(monkeypatch_module):
    """A local cluster whose memory the suite can count on (issue 42.14): a bounded object store, and no kills by
    Ray's memory monitor, which acts on the whole node's use: beside the suite's other worker it killed these
    workers (0.3 GB each) at 22.2 of 23.5 GB. The kernel still bounds the processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch_module.setenv("RAY_memory_monitor_refresh_ms", "0")  # read by the raylet that ray.init starts
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=OBJECT_STORE)
    yield
    ray.shutdown()
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def full_run(cluster, tmp_path_factory):
    """3 iterations with 2 workers, checkpointed every iteration."""
    return train(tiny(tmp_path_factory.mktemp("full"), checkpoint_every=1))


def test_config_refuses_worker_settings_it_cannot_honour():
    with pytest.raises(ValueError, match=r"num_workers=9 must be an int in \[0, num_envs=8\]"):
        PPOConfig(num_envs=8, num_minibatches=2, num_workers=9)
    with pytest.raises(ValueError, match=r"ray_address='auto' is set but num_workers=0"):
        PPOConfig(ray_address="auto")
    with pytest.raises(ValueError, match=r"async_rollout=True needs num_workers >= 1 \(got num_workers=0\)"):
        PPOConfig(async_rollout=True)


def test_a_worker_runs_in_the_runs_deterministic_mode(tmp_path):
    """Issue 37.8: ``--deterministic`` reached the learner only; a worker sampled with torch's default kernels."""
    from textgym.agents.ppo.ray_rollout import RolloutWorker

    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        worker = RolloutWorker(tiny(tmp_path, deterministic=True).to_dict(), {}, 0, 2, bf16=False)
        assert torch.are_deterministic_algorithms_enabled()
        worker.close()
    finally:
        torch.use_deterministic_algorithms(before)


def test_the_worker_settings_are_train_flags():
    import argparse

    from textgym.agents.ppo.config import add_config_args, config_from_args

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    cfg = config_from_args(
        parser.parse_args(["--num-workers", "2", "--ray-address", "10.0.0.1:6379", "--async-rollout"])
    )
    assert (cfg.num_workers, cfg.ray_address, cfg.async_rollout) == (2, "10.0.0.1:6379", True)
    assert "Ray actors" in parser.format_help()  # the help text comes from the config's docstring


def test_same_seed_and_workers_give_the_same_run_and_resume_continues_exactly(full_run, tmp_path):
    part = train(tiny(tmp_path, total_episodes=16, checkpoint_every=2))
    assert [numbers(r) for r in part] == [numbers(r) for r in full_run[:2]]
    resumed = train(tiny(tmp_path, checkpoint_every=2, resume=True))  # the same run, continued from iteration 2
    assert [r["iteration"] for r in resumed] == [1, 2, 3]
    for key, value in numbers(full_run[2]).items():
        assert resumed[2][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_a_worker_killed_mid_rollout_is_replaced_and_no_episode_is_lost(full_run, tmp_path):
    t = Trainer.create(tiny(tmp_path))
    local = Trainer.create(tiny(tmp_path, num_workers=0))
    try:
        first = t.iteration()
        in_process = local.iteration()
        # the layout of K = 0: the same columns, and slot s seeded with seed + s (the same prompts)
        assert set(first) == set(in_process)
        assert list(t.last_episodes["prompt"]) == list(local.last_episodes["prompt"])
        pid = ray.get(t.rollouts.pool.workers[1].pid.remote())
        os.kill(pid, signal.SIGSTOP)  # frozen: its share cannot finish before the kill
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        with pytest.warns(UserWarning, match="rollout worker 1 died"):
            second = t.iteration()
        assert t.rollouts.pool.replaced == 1 and ray.get(t.rollouts.pool.workers[1].pid.remote()) != pid
    finally:
        t.close()
        local.close()
    assert second["episodes"] - first["episodes"] == t.cfg.num_envs == t.last_episodes.batch_size[0]
    # collected again from the same RNG state with the same weights: the run of the undisturbed workers
    assert [numbers(first), numbers(second)] == [numbers(r) for r in full_run[:2]]


def test_async_rollout_samples_one_update_behind_and_resumes_exactly(full_run, tmp_path):
    cfg = tiny(tmp_path, async_rollout=True)
    t = Trainer.create(cfg)
    try:
        rows = [t.iteration(), t.iteration()]
        (tmp_path / "run").mkdir()
        t.save(tmp_path / "run")  # holds the rollout already collected for iteration 3
        rows.append(t.iteration())
    finally:
        t.close()
    # the first rollout waits (nothing to overlap yet): the synchronous iteration, up to π_old being the sampled
    # log-probs rather than their teacher-forced recomputation (equal to float rounding in fp32)
    for key, value in numbers(full_run[0]).items():
        assert rows[0][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    # iteration 2 trains on episodes sampled before update 1: the recomputed log-probs lag the sampled ones
    assert rows[1]["logprob_mismatch_max"] > 100 * full_run[1]["logprob_mismatch_max"]
    resumed = Trainer.create(cfg)
    try:
        resumed.load(tmp_path / "run" / "checkpoint")
        again = resumed.iteration()
    finally:
        resumed.close()
    for key, value in numbers(rows[2]).items():
        assert again[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_grpo_groups_and_lora_adapters_reach_the_workers(cluster, tmp_path):
    t = Trainer.create(tiny(tmp_path, algo="grpo", group_size=4, lora_rank=4, learning_rate=3e-2))
    try:
        rows = [t.iteration(), t.iteration()]
        prompts = list(t.last_episodes["prompt"])
    finally:
        t.close()
    assert prompts[:4] == [prompts[0]] * 4 and prompts[4:] == [prompts[4]] * 4  # the learner's group prompts
    # the workers sampled iteration 2 with the updated adapters: their log-probs are the learner's
    assert rows[1]["approx_kl"] > 1e-4, "the update should move the policy, else this shows nothing"
    assert rows[1]["logprob_mismatch_max"] < 1e-4


def test_a_textgym_checkout_in_the_working_directory_is_refused_before_the_workers_start(tmp_path):
    """Issue 27.7: Ray puts the driver's working directory first on its workers' path, so a stale textgym/ there
    made every worker fail with NameNotFound; the run now stops at once, naming the folder and the fix."""
    (tmp_path / "textgym").mkdir()
    (tmp_path / "textgym" / "__init__.py").write_text('"""another checkout"""\n')
    textgym_cli = Path(sys.executable).with_name("textgym")
    out = subprocess.run([str(textgym_cli), "train", "--config", "tiny", "--num-workers", "1", "--out", "run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"num_workers > 0 from {tmp_path}: its textgym/ folder would shadow" in out.stderr
    assert "start the run from another folder" in out.stderr and "Traceback" not in out.stderr


def test_a_worker_that_imported_another_textgym_says_so():
    from textgym.agents.ppo.ray_rollout import check_package_home, package_home

    check_package_home(package_home())  # the same package: nothing to say
    with pytest.raises(ImportError, match=r"imported textgym from .* the learner from /elsewhere/textgym"):
        check_package_home("/elsewhere/textgym")


def test_the_test_cluster_holds_a_bounded_object_store(cluster):
    """Last in the module: a test above builds a RolloutWorker in this process, which needs no cluster up."""
    assert ray.cluster_resources()["object_store_memory"] <= OBJECT_STORE
