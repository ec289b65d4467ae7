"""Nothing lost, nothing wrong, nothing run (issue 27): what a fault trial of the run folder found.

A crash during the last save, a reward beyond float32, a non-finite loss or weight, code named by a
run-info file, a lock that is a link, config values of the wrong type, a hanging reward model, a
full disk, a read-only folder, SIGTERM: each either recovers exactly or stops with one clear error,
and nothing non-finite or half-written reaches the run folder.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import pytest
import torch

from textgym.agents.ppo import PPOConfig, Trainer, train
from textgym.agents.ppo.config import PRESETS
from textgym.rewards import RewardModelError, register
from textgym.rewards.registry import _REGISTRY

RM_VALUE = {"value": 0.5}  # what the "test-switch" reward model returns; a test sets it beyond float32
HANG = threading.Event()  # set: the "test-hang" reward model waits (up to 60 s) before returning


def _switch_rm(prompts: list[str], responses: list[str]) -> list[float]:
    return [RM_VALUE["value"] + 0.01 * len(r) for r in responses]


def _hanging_rm(prompts: list[str], responses: list[str]) -> list[float]:
    HANG.wait(60)
    return [0.0] * len(responses)


SCORED = {"episodes": 0, "fail_after": None}  # "test-late" raises once it would score more than fail_after episodes


def _late_failing_rm(prompts: list[str], responses: list[str]) -> list[float]:
    SCORED["episodes"] += len(responses)
    if SCORED["fail_after"] is not None and SCORED["episodes"] > SCORED["fail_after"]:
        raise RuntimeError("test-late: the reward server went away")
    return [0.01 * len(r) for r in responses]


@pytest.fixture(autouse=True, scope="module")
def _test_reward_models():
    """Register this module's two reward models while its tests run, and only then: the registry is
    process-wide, and other modules' tests read its list of names (the unknown-name error message)."""
    register("test-switch", lambda: _switch_rm)
    register("test-hang", lambda: _hanging_rm)
    register("test-late", lambda: _late_failing_rm)
    yield
    for name in ("test-switch", "test-hang", "test-late"):
        _REGISTRY.pop(name)


def tiny(out, **changes) -> PPOConfig:
    return PPOConfig(**{**PRESETS["tiny"], "out": str(out), "checkpoint_every": 1, **changes})


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- 0. a run stopped by an error
NUMBERS = ("episodes", "env_steps", "rm_score", "score", "gold_score", "kl", "kl_coef", "response_length",
           "explained_variance", "policy_loss", "value_loss", "approx_kl", "entropy")  # fmt: skip


def test_a_run_stopped_by_an_error_saves_its_last_iteration_and_resumes_to_the_uninterrupted_run(tmp_path, capsys):
    """Issue 37.9: a checkpoint came only every checkpoint_every iterations, so an error lost the iterations since.

    The error comes in iteration 3's rollout: the checkpoint of iteration 2 is saved (its RNG states as they
    were when iteration 2 ended), and the resumed run's numbers equal an uninterrupted run's.
    """
    config = {"reward_model": "test-late", "total_episodes": 24, "checkpoint_every": 10}  # 3 iterations of 8
    whole = train(tiny(tmp_path / "whole", **config))
    SCORED.update(episodes=0, fail_after=16)
    out = tmp_path / "run"
    try:
        with pytest.raises(RewardModelError, match="the reward server went away"):
            train(tiny(out, **config))
    finally:
        SCORED["fail_after"] = None
    assert json.loads((out / "checkpoint" / "state.json").read_text())["iteration"] == 2
    assert f"the checkpoint of iteration 2 is saved in {out / 'checkpoint'}" in capsys.readouterr().err
    train(tiny(out, **config, resume=True))
    assert [{k: r[k] for k in NUMBERS} for r in rows(out)] == [{k: r[k] for k in NUMBERS} for r in whole]


# ---------------------------------------------------------------- 1. a crash during the last save
def test_exports_left_behind_by_a_crash_in_the_last_save_are_re_exported_on_resume(run):
    """A kill after the last save's checkpoint swap, before its policy/ and value/ swaps, leaves the exports an
    iteration behind (weights and beta); the resume, which has nothing left to train, re-exports them."""
    from safetensors.torch import load_file, save_file

    for folder in ("policy", "value"):
        path = run / folder / "model.safetensors"
        weights = load_file(path)
        path.unlink()  # a file of its own: the checkpoint's hard-linked one stays as it is
        save_file({k: v + 1.0 for k, v in weights.items()}, path)
    info = json.loads((run / "policy" / "textgym_run.json").read_text())
    (run / "policy" / "textgym_run.json").write_text(json.dumps({**info, "kl_coef": 0.123}))
    assert sha(run / "policy" / "model.safetensors") != sha(run / "checkpoint" / "policy" / "model.safetensors")

    with pytest.warns(UserWarning, match=r"policy, value do not match .*checkpoint.*re-exported"):
        history = train(tiny(run, resume=True))
    assert [r["iteration"] for r in history] == [1, 2]
    assert sha(run / "policy" / "model.safetensors") == sha(run / "checkpoint" / "policy" / "model.safetensors")
    assert sha(run / "value" / "model.safetensors") == sha(run / "checkpoint" / "critic" / "model.safetensors")
    assert json.loads((run / "policy" / "textgym_run.json").read_text())["kl_coef"] == rows(run)[-1]["kl_coef"]


TIMING = ("tokens_per_s", "time_")  # metrics that measure the machine, not the run


def same_run(rows_: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows_]


def test_a_run_killed_before_its_first_save_starts_again_on_resume(done_run, tmp_path):
    """Killed after iteration 1's metrics row, before its checkpoint: nothing to continue, so the run restarts."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps(rows(done_run)[0]) + "\n")
    (out / f".checkpoint.{'cd' * 16}").mkdir()  # the save's unfinished temp folder
    with pytest.warns(UserWarning, match=r"no checkpoint was ever saved .* starts again from iteration 1"):
        history = train(tiny(out, resume=True))
    assert same_run(history) == same_run(rows(done_run)) == same_run(rows(out))


def test_a_resume_of_a_finished_run_with_matching_exports_rewrites_nothing(run):
    before = (run / "policy").stat().st_ino, (run / "value").stat().st_ino
    train(tiny(run, resume=True))
    assert ((run / "policy").stat().st_ino, (run / "value").stat().st_ino) == before


# ---------------------------------------------------------------- 2. nothing non-finite reaches a save
def test_a_reward_beyond_float32_is_refused_and_the_checkpoint_stays_good(tmp_path):
    out = tmp_path / "run"
    train(tiny(out, reward_model="test-switch", total_episodes=8))
    good = sha(out / "checkpoint" / "policy" / "model.safetensors")
    RM_VALUE["value"] = 1e308  # finite in float64, inf in the float32 buffers
    try:
        with pytest.raises(RewardModelError, match=r"test-switch.*1e\+308.*not finite in float32"):
            train(tiny(out, reward_model="test-switch", total_episodes=16, resume=True))
    finally:
        RM_VALUE["value"] = 0.5
    assert json.loads((out / "checkpoint" / "state.json").read_text())["iteration"] == 1
    assert sha(out / "checkpoint" / "policy" / "model.safetensors") == good


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    t = Trainer.create(tiny(tmp_path_factory.mktemp("t") / "run"))
    yield t
    t.close()


def test_a_non_finite_loss_refuses_the_update_naming_the_quantity(trainer):
    from textgym.agents.ppo.guards import NonFiniteError

    real_loss = trainer.loss

    def nan_loss(mb):
        out = real_loss(mb)
        out["loss_objective"] = out["loss_objective"] * float("nan")
        return out

    before = [p.detach().clone() for p in trainer.policy.parameters()]
    trainer.loss = nan_loss
    try:
        with pytest.raises(NonFiniteError, match=r"iteration 1: the policy_loss is nan.*update refused"):
            trainer.iteration()
    finally:
        trainer.loss = real_loss
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters())), "no step was taken"


def test_a_non_finite_weight_never_reaches_a_save(trainer, tmp_path):
    from textgym.agents.ppo.guards import NonFiniteError

    param = next(trainer.critic.parameters())
    kept = param.detach().clone()
    with torch.no_grad():
        param[0] = float("inf")
    try:
        with pytest.raises(NonFiniteError, match=r"critic weight .* is not finite.*not saved"):
            trainer.save(tmp_path / "out")
    finally:
        with torch.no_grad():
            param.copy_(kept)
    assert not (tmp_path / "out").exists(), "nothing was written"


# ---------------------------------------------------------------- 3. a run-info file runs no code
def _planted(done_run, tmp_path, folder: str, code: str, **info_changes) -> tuple[Path, Path]:
    """A copy of the run's policy folder holding ``evil.py`` (it creates a marker file when imported, then runs
    ``code``) and a run-info file changed by ``info_changes``; returns the folder and the marker's path."""
    pol = Path(shutil.copytree(done_run / "policy", tmp_path / folder))
    marker = tmp_path / "code-ran"
    (pol / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n{code}")
    info = json.loads((pol / "textgym_run.json").read_text())
    (pol / "textgym_run.json").write_text(json.dumps({**info, **info_changes}))
    return pol, marker


def test_a_module_attr_reward_model_in_a_run_info_file_is_refused(done_run, tmp_path, monkeypatch):
    from textgym.agents.evaluate import evaluate

    pol, marker = _planted(done_run, tmp_path, "pol", "def rm(p, r):\n    return [0.0] * len(r)\n",
                           reward_model="pol.evil:rm")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"textgym_run\.json names reward_model='pol\.evil:rm'.*--reward-model"):
        evaluate(str(pol), episodes=2, num_envs=2)
    assert not marker.exists(), "the module named by the run-info file was imported"
    result = evaluate(str(pol), episodes=2, num_envs=2, reward_model="pol.evil:rm")  # given by the user: taken
    assert marker.exists() and result["rm_score"][0] == 0.0


def test_the_gold_scorer_of_a_run_info_file_is_taken_by_name_and_refused_as_code(done_run, tmp_path, monkeypatch):
    """A run trained with gold_scorer= is evaluated with it; a 'module:attr' there runs no code either."""
    from textgym.agents.evaluate import evaluate

    pol = Path(shutil.copytree(done_run / "policy", tmp_path / "pol"))
    info = json.loads((pol / "textgym_run.json").read_text())
    (pol / "textgym_run.json").write_text(json.dumps({**info, "gold_scorer": "length"}))
    result = evaluate(str(pol), episodes=2, num_envs=2)
    for sample in result["samples"]:  # LengthReward's -|words - 20| / 20, not VADER's compound score
        assert sample["gold_score"] == pytest.approx(-abs(len(sample["response"].split()) - 20) / 20)
    (pol / "textgym_run.json").write_text(json.dumps({**info, "gold_scorer": "pol.evil:rm"}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"names gold_scorer='pol\.evil:rm'.*--gold-scorer 'pol\.evil:rm'"):
        evaluate(str(pol), episodes=2, num_envs=2)


def test_a_module_path_env_id_in_a_run_info_file_is_refused(done_run, tmp_path, monkeypatch, capsys):
    """Issue 37.3: a run-info ``env_id`` of ``module:EnvName`` made gym.make import the module: code that came with
    the weights ran on `textgym eval --policy` from the folder's parent."""
    from textgym.agents.evaluate import evaluate
    from textgym.cli import main

    pol, marker = _planted(done_run, tmp_path, "envpol", "", env_id="envpol.evil:TextRLHF-v0")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # as `python -m textgym.cli` from the parent folder
    with pytest.raises(ValueError, match=r"textgym_run\.json names env_id='envpol\.evil:TextRLHF-v0', a module"):
        evaluate(str(pol), episodes=2, num_envs=2)
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--policy", "envpol", "--episodes", "2", "--num-envs", "2", "--no-progress"])
    assert exit_.value.code == 2 and "names env_id='envpol.evil:TextRLHF-v0'" in capsys.readouterr().err
    assert not marker.exists(), "the module named by the run-info file was imported"
    evaluate(str(pol), episodes=2, num_envs=2, env_id="envpol.evil:TextRLHF-v0")  # given by the caller: taken
    assert marker.exists()


def test_eval_prints_what_it_took_from_the_run_info(done_run, capsys):
    from textgym.cli import main

    main(["eval", "--policy", str(done_run / "policy"), "--episodes", "2", "--num-envs", "2", "--no-progress"])
    err = capsys.readouterr().err
    info = json.loads((done_run / "policy" / "textgym_run.json").read_text())
    assert f"from {done_run / 'policy' / 'textgym_run.json'}" in err
    assert f"kl_coef={info['kl_coef']}" in err and "max_new_tokens=6" in err


# ---------------------------------------------------------------- 4. the lock follows no link
def test_a_lock_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    from textgym.files import lock_folder

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".lock").symlink_to(victim)
    with pytest.raises(ValueError, match=r"out='.*out': its lock .*\.lock is a symbolic link"):
        with lock_folder(tmp_path / "out", "out"):
            pass
    assert victim.read_text() == "precious\n"


def test_a_lock_that_is_a_directory_is_refused_with_a_clear_message(tmp_path):
    from textgym.files import lock_folder

    (tmp_path / "out" / ".lock").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"out='.*out': its lock .*\.lock is a directory"):
        with lock_folder(tmp_path / "out", "out"):
            pass


def test_a_lock_that_is_a_hard_link_is_refused_and_the_other_file_untouched(tmp_path):
    """Issue 37.4: O_NOFOLLOW stops a symlink, not a hard link: the trainer's pid was written into the other file."""
    from textgym.files import lock_folder

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "out").mkdir()
    os.link(victim, tmp_path / "out" / ".lock")
    with pytest.raises(ValueError, match=r"out='.*out': its lock .*\.lock is a hard link \(2 names"):
        with lock_folder(tmp_path / "out", "out"):
            pass
    assert victim.read_text() == "precious\n"


def test_a_lock_that_is_a_fifo_is_refused_with_a_clear_message(tmp_path):
    """Issue 37.4: a FIFO at the lock's name gave a bare '[Errno 22] Invalid argument'."""
    from textgym.files import lock_folder

    (tmp_path / "out").mkdir()
    os.mkfifo(tmp_path / "out" / ".lock")
    with pytest.raises(ValueError, match=r"out='.*out': its lock .*\.lock is a FIFO .*remove it \(rm "):
        with lock_folder(tmp_path / "out", "out"):
            pass


def test_a_symlinked_temp_file_in_out_never_writes_its_target(tmp_path):
    """Issue 37.4: a symlink at ``OUT/.samples.jsonl.tmp`` made the rewritten samples go into its target, and the
    start's recovery removed the other stale temp files but not this one."""
    from textgym.agents.ppo import run_folder

    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious\n")
    (out / "samples.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n')
    for name in ("samples.jsonl", "metrics.jsonl", "config.json"):
        (out / f".{name}.tmp").symlink_to(victim)
    run_folder.start_files(out, [{"iteration": 1}], 1, {"seed": 0})
    assert victim.read_text() == "precious\n"
    assert (out / "samples.jsonl").read_text() == '{"iteration": 1}\n' and not (out / "samples.jsonl").is_symlink()
    assert (out / "metrics.jsonl").read_text() == '{"iteration": 1}\n'
    (out / ".samples.jsonl.tmp").symlink_to(tmp_path / "elsewhere")
    run_folder.open_run_folder(out, tiny(out), overwrite=True)
    assert not os.path.lexists(out / ".samples.jsonl.tmp"), "recovery drops the stale samples temp file too"


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl", "config.json", "tensorboard", "checkpoint"])
def test_a_run_entry_that_is_a_symlink_is_refused_at_the_start(tmp_path, name):
    """Issue 37.4: a symlinked (here dangling) ``OUT/samples.jsonl`` was skipped by the start's rewrite and the
    appends followed it, creating its target outside OUT; a symlinked run file or folder is refused before any
    model loads."""
    from textgym.agents.ppo import run_folder

    out, target = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    (out / name).symlink_to(target)
    with pytest.raises(ValueError, match=rf"out='.*out': its (file|folder) .*{name} is a symbolic link .*remove it"):
        run_folder.open_run_folder(out, tiny(out), overwrite=True)
    assert not target.exists()


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl"])
@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_an_append_never_writes_through_a_link(tmp_path, name, link):
    """Issue 37.4: the appends to ``OUT/metrics.jsonl`` and ``OUT/samples.jsonl`` opened whatever the name reached."""
    from textgym.agents.ppo import run_folder

    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious\n")
    os.symlink(victim, out / name) if link == "symlink" else os.link(victim, out / name)
    what = "a symbolic link" if link == "symlink" else r"a hard link \(2 names"
    append = run_folder.append_metrics if name == "metrics.jsonl" else run_folder.append_samples
    with pytest.raises(ValueError, match=rf"out='.*out': its file .*{name} is {what}.*remove it \(rm "):
        append(out, {"iteration": 1} if name == "metrics.jsonl" else [{"iteration": 1}])
    assert victim.read_text() == "precious\n"


def test_a_hard_linked_copy_of_a_run_resumes_without_changing_the_original(run, tmp_path):
    """A ``cp -al`` copy shares every file with its original: the start replaces the run files by a rename, so the
    resumed copy's metrics, samples and config never reach the original's (hard links are allowed there)."""
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-al", str(run), str(copy)], check=True)
    before = {name: sha(run / name) for name in ("metrics.jsonl", "config.json")}
    train(tiny(copy, resume=True, total_episodes=tiny(copy).total_episodes * 2, samples_every=1))
    assert {name: sha(run / name) for name in before} == before
    assert len(rows(copy)) > len(rows(run))


# ---------------------------------------------------------------- 5. config values of the wrong type
@pytest.mark.parametrize(
    "field, value, kind",
    [("resume", "no", "bool"), ("whiten_rewards", "false", "bool"), ("seed", "0", "int"),
     ("learning_rate", "1e-4", "float"), ("gamma", "1", "float"), ("top_k", 2.5, "int or None"),
     ("model", 3, "str or None"), ("num_envs", True, "int")],
)  # fmt: skip
def test_config_values_of_the_wrong_type_are_refused_naming_the_field(field, value, kind):
    with pytest.raises(
        ValueError, match=rf"^{field}={value!r} is an? {type(value).__name__}; {field} takes an? {kind}"
    ):
        PPOConfig(**{field: value})


@pytest.mark.parametrize("field", ["reward_model", "gold_scorer"])
def test_a_reward_function_in_the_config_is_refused_naming_register(field):
    """Issue 37.9: the refusal said only "takes a str or None"; the way to train on a function is register()."""
    from textgym.rewards import KeywordReward

    for value in (lambda prompts, responses: [0.0] * len(prompts), KeywordReward("great")):
        with pytest.raises(ValueError, match=rf"^{field}=.* is a reward model object, not a name: the config is saved "
                           rf"as JSON; register it with textgym.rewards.register\('my-rm', .*\) and pass "
                           rf"{field}='my-rm'"):  # fmt: skip
            PPOConfig(**{field: value})


def test_a_config_file_with_a_string_bool_fails_before_any_model_loads(run, tmp_path, capsys):
    from textgym.cli import main

    config = tmp_path / "c.json"
    config.write_text(json.dumps({**PRESETS["tiny"], "out": str(run), "resume": "no"}))
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config-file", str(config)])
    assert exit_.value.code == 2
    assert "resume='no' is a str; resume takes a bool" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == before


def test_a_batch_beyond_the_machines_memory_is_refused_with_the_estimate(tmp_path, monkeypatch):
    from textgym import memory as guards  # the guard reads the machine's memory through textgym.memory
    from textgym.agents.ppo.guards import estimate_rollout_bytes

    cfg = tiny(tmp_path / "run", num_envs=100000, total_episodes=100000)
    need = estimate_rollout_bytes(cfg)
    assert need > estimate_rollout_bytes(tiny(tmp_path / "run", num_envs=1000, total_episodes=1000)) * 50
    monkeypatch.setattr(guards, "available_memory", lambda: need // 2)
    with pytest.raises(ValueError, match=r"num_envs=100000 needs about [\d.]+ GiB .* [\d.]+ GiB"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoint").exists()


def test_a_batch_whose_peak_passes_the_machines_memory_is_refused_whatever_is_free_now(tmp_path, monkeypatch):
    """Issue 37.5: the refusal compared the estimate (a lower bound) with the memory free at that moment, so
    num_envs=100000 (19 GiB) ran for minutes on a machine with about that much free. The peak it implies (the
    measured PEAK_OVER_ESTIMATE times it) is held against the machine's memory, whatever is free, and against what
    is free now."""
    from textgym import memory as guards  # the guard reads the machine's memory through textgym.memory
    from textgym.agents.ppo.guards import PEAK_OVER_ESTIMATE, check_memory, estimate_rollout_bytes

    cfg = tiny(tmp_path / "run", num_envs=16000, total_episodes=16000)
    need = estimate_rollout_bytes(cfg)
    monkeypatch.setattr(guards, "total_memory", lambda: PEAK_OVER_ESTIMATE * need // 2)
    monkeypatch.setattr(guards, "available_memory", lambda: 100 * need)
    with pytest.raises(ValueError, match=r"num_envs=16000 needs about [\d.]+ GiB .* about 10 times it, [\d.]+ GiB, "
                                         r"more than the [\d.]+ GiB this machine has"):  # fmt: skip
        check_memory(cfg)
    monkeypatch.setattr(guards, "total_memory", lambda: 100 * need)
    monkeypatch.setattr(guards, "available_memory", lambda: PEAK_OVER_ESTIMATE * need // 2)
    with pytest.raises(ValueError, match=r"more than the [\d.]+ GiB available now"):
        check_memory(cfg)
    monkeypatch.setattr(guards, "available_memory", lambda: 2 * PEAK_OVER_ESTIMATE * need)
    check_memory(cfg)  # its peak fits twice in what is free: it runs


def test_a_refused_batch_writes_nothing_into_out(tmp_path, monkeypatch):
    """Issue 37.5: the memory check came after OUT was created and locked."""
    from textgym import memory as guards  # the guard reads the machine's memory through textgym.memory

    monkeypatch.setattr(guards, "available_memory", lambda: 2**20)
    with pytest.raises(ValueError, match=r"num_envs=8 needs about"):
        train(tiny(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- 6. a reward-model timeout for train
def test_train_has_a_reward_timeout_that_names_the_model_and_the_seconds(tmp_path):
    assert PPOConfig().reward_timeout == 300.0 and PPOConfig().env_kwargs()["reward_timeout"] == 300.0
    HANG.clear()
    start = time.perf_counter()
    try:
        with pytest.raises(RewardModelError, match=r"reward model 'test-hang' did not return within "
                                                    r"reward_timeout=0.5 s"):  # fmt: skip
            train(tiny(tmp_path / "run", reward_model="test-hang", reward_timeout=0.5))
    finally:
        HANG.set()
    assert time.perf_counter() - start < 30


def test_reward_timeout_is_a_train_flag(tmp_path):
    from textgym.cli import main

    main(["train", "--config", "tiny", "--out", str(tmp_path), "--reward-timeout", "7.5", "--print-config"])
    with pytest.raises(ValueError, match=r"reward_timeout=-1.0 must be a finite float > 0"):
        PPOConfig(reward_timeout=-1.0)


# ---------------------------------------------------------------- 7. disk full, read-only, SIGTERM
def test_a_full_disk_during_a_save_says_so_and_names_the_folder(trainer, tmp_path, monkeypatch):
    import errno

    import textgym.files as utils

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5376 vs 5264")

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(utils, "_free_bytes", lambda path: 0)
    with pytest.raises(OSError, match=r"no space left on the device holding .*out.*checkpoint") as err:
        trainer.save(tmp_path / "out")
    assert err.value.errno == errno.ENOSPC
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".checkpoint")]


def test_a_full_disk_inside_safetensors_names_the_disk_and_the_folder(trainer, tmp_path, monkeypatch):
    """Issue 37.6: safetensors reports ENOSPC as its own SafetensorError (no OSError, no errno): it came out as a
    raw traceback. The error it raises on a full tmpfs, from a writer that had begun its file."""
    import errno

    import transformers.modeling_utils
    from safetensors import SafetensorError

    import textgym.files as utils

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    monkeypatch.setattr(utils, "_free_bytes", lambda path: 3 * 2**20)
    out = tmp_path / "out"
    with pytest.raises(OSError, match=r"no space left on the device holding .*out/checkpoint") as err:
        trainer.save(out)
    assert err.value.errno == errno.ENOSPC
    disk = Path(tmp_path)
    while not os.path.ismount(disk):
        disk = disk.parent
    assert f"the file system mounted at {disk}" in str(err.value) and "3.0 MiB free" in str(err.value)
    assert "SafetensorError" in str(err.value)
    assert not list(out.iterdir()), "nothing half-written is left"


def test_a_full_disk_during_an_atomic_file_write_leaves_no_temp_file(tmp_path, monkeypatch):
    import errno

    from textgym.files import write_text_atomically

    (tmp_path / "config.json").write_text("old\n")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomically(tmp_path / "config.json", "new\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert (tmp_path / "config.json").read_text() == "old\n"


def test_an_out_on_a_read_only_file_system_is_one_clear_error(tmp_path, capsys, monkeypatch):
    import errno

    from textgym.cli import main

    out = tmp_path / "ro" / "run"
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self == out:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", "tiny", "--out", str(out)])
    assert exit_.value.code == 2
    assert f"out={str(out)!r} cannot be created (Read-only file system)" in capsys.readouterr().err


def _without_root_overrides() -> None:
    """In the child before exec: drop root's CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set,
    so the command it execs is denied what file modes deny, as any user is (PR_CAPBSET_DROP = 24)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def test_a_read_only_out_is_one_clear_error(tmp_path):
    """A folder this user may not write is refused by name. Root writes anywhere, so under root (as in CI) the
    command runs without root's permission overrides: the kernel's own check, never skipped."""
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    drop = {"preexec_fn": _without_root_overrides} if os.geteuid() == 0 else {}
    try:
        proc = subprocess.run([sys.executable, "-m", "textgym.cli", "train", "--config", "tiny", "--out", str(out)],
                              env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=120,
                              **drop)  # fmt: skip
    finally:
        out.chmod(0o755)
    assert proc.returncode == 2, proc.stderr
    assert f"out={str(out)!r} is not writable (no write permission for this user)" in proc.stderr


def _train_script(out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "textgym.cli", "train", "--config", "tiny", "--out", str(out), "--threads", "1",
            "--total-episodes", "800", *flags]  # fmt: skip


def test_sigterm_stops_a_run_saying_what_was_saved(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(_train_script(out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoint").is_dir():
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    saved = json.loads((out / "checkpoint" / "state.json").read_text())["iteration"]
    assert proc.returncode == 128 + signal.SIGTERM
    assert f"stopped by SIGTERM; the checkpoint in {out / 'checkpoint'} holds iteration {saved}" in err
    assert "--resume" in err


HANGS_ON_STOP = """
import time
from textgym.agents.ppo.guards import stop_on_sigterm
with stop_on_sigterm(grace=1.0):
    try:
        print("ready", flush=True)
        time.sleep(60)
    finally:
        time.sleep(4)  # a cleanup that does not end: the stop hangs
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_that_hangs_prints_every_threads_stack(signum):
    # a shell without job control starts background jobs with SIGINT ignored, and children inherit that: give the
    # child the default, as a terminal's would have (else Python installs no Ctrl-C handler and the guard none)
    proc = subprocess.Popen([sys.executable, "-c", HANGS_ON_STOP], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert "Timeout (0:00:01)!" in err and "most recent call first" in err, err
    assert ("KeyboardInterrupt" if signum == signal.SIGINT else "Stopped: SIGTERM") in err


# ---------------------------------------------------------------- the fault trial's kill loop
@pytest.mark.slow
def test_the_fault_trials_kill_loop_resumes_to_the_uninterrupted_run(tmp_path):
    """bench/fault_trial.py --quick: kill -9 in the last save (before the policy's swap) and at a random moment,
    resume each to the end: metrics, samples, state and weight hashes equal the uninterrupted run's."""
    script = Path(__file__).parents[1] / "bench" / "fault_trial.py"
    args = ["--quick", "--episodes", "16", "--max-kills", "1", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "kill at rename 10/15: 1 kill(s), then resumed: identical" in done.stdout
    assert "2 of 2 trials identical to the uninterrupted run" in done.stdout


def test_the_env_refuses_slots_beyond_the_machines_memory_before_allocating_them(monkeypatch):
    """Issue 42.5: 10**5 and 10**6 slots ran into a watchdog; the env refuses them, naming how many fit."""
    from textgym import memory
    from textgym.envs.engine import slot_bytes

    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"^num_envs=1000000 needs at least [\d.]+ GiB for the env's slots \([\d.]+ "
                       r"MiB each: π_ref's next-token logits over 2048 tokens, its KV cache of \d+ columns and the "
                       r"observations\), more than the [\d.]+ GiB (this machine has|available now); at most \d+ slots "
                       r"fit"):  # fmt: skip
        gym.make_vec("TextRLHF-v0", num_envs=10**6, vectorization_mode="vector_entry_point")
    assert time.perf_counter() - start < 30
    per_slot = slot_bytes(2048, 4, 64, 4, 10, 6, cached=True)
    assert per_slot == 2048 * 4 + 2 * 4 * 64 * 11 * 4 + 2 * 10 * 8 + 6 * 9  # logits, K and V, obs, turn arrays
    monkeypatch.setattr(memory, "available_memory", lambda: 300 * 2**20)
    with pytest.raises(ValueError, match=r"num_envs=5000 .* more than the 0.29 GiB available now; at most \d+ slots"):
        gym.make_vec("TextRLHF-v0", num_envs=5000, vectorization_mode="vector_entry_point", max_new_tokens=4)


def test_the_batch_guard_reads_named_models_and_counts_the_prompt_block(tmp_path, monkeypatch):
    """Issue 42.5: the guard skipped a named model (smollm2-guess-ppo with 2048 slots was not refused, its folder
    path was), and its estimate left out the prompt block (185-1100+ tokens for a game's opening)."""
    from textgym import memory
    from textgym.agents.ppo.config import PRESETS
    from textgym.agents.ppo.guards import check_memory, estimate_rollout_bytes
    from textgym.named_models import smollm2_folder

    named = PPOConfig(**{**PRESETS["smollm2-guess-ppo"], "num_envs": 2048, "out": str(tmp_path / "run")})
    by_path = PPOConfig(**{**named.to_dict(), "model": str(smollm2_folder())})
    assert estimate_rollout_bytes(named) == estimate_rollout_bytes(by_path) is not None
    monkeypatch.setattr(memory, "total_memory", lambda: 24 * 2**30)
    monkeypatch.setattr(memory, "available_memory", lambda: 20 * 2**30)
    with pytest.raises(ValueError, match=r"num_envs=2048 needs about"):
        check_memory(named)
    tiny_cfg = tiny(tmp_path / "run")
    layers, kv_width = 4, 256  # the embedded LM: 4 layers, 4 KV heads of 64
    extra = estimate_rollout_bytes(tiny_cfg, prompt_block=1001) - estimate_rollout_bytes(tiny_cfg)
    itemsize = 4 if tiny_cfg.precision == "fp32" else 2  # the sampler's cache: bf16 under autocast
    assert extra == tiny_cfg.num_envs * 2 * layers * kv_width * 1000 * itemsize
    # the preset itself passes: its one-iteration peak was 4.42 GiB, the guard's bound 10 x 0.40 GiB
    grpo = PPOConfig(**{**PRESETS["smollm2-guess-grpo"], "out": str(tmp_path / "grpo")})
    monkeypatch.setattr(memory, "available_memory", lambda: 8 * 2**30)
    check_memory(grpo, prompt_block=270)
