"""A run folder never loses work and never trusts what it loads: atomic checkpoints, resume, the lock."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from textgym.agents.ppo import PPOConfig, Trainer, train
from textgym.agents.ppo.config import PRESETS


def tiny(out, **changes) -> PPOConfig:
    return PPOConfig(**{**PRESETS["tiny"], "out": str(out), "checkpoint_every": 1, **changes})


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A trainer of the same run with other learning rates, to load checkpoints into."""
    return Trainer.create(tiny(tmp_path_factory.mktemp("t") / "run", learning_rate=3e-4, critic_learning_rate=5e-4))


# ---------------------------------------------------------------- 1. atomic saves and their recovery
def test_resume_after_a_crash_between_the_two_renames_continues(run):
    """The state an interrupted swap left: no OUT/checkpoint, complete copies in .checkpoint.old and .checkpoint.<id>"""
    before = rows(run)
    shutil.copytree(run / "checkpoint", run / f".checkpoint.{'ab' * 16}")
    (run / "checkpoint").rename(run / ".checkpoint.old")
    with pytest.warns(UserWarning, match=r"restored the previous version \.checkpoint\.old as checkpoint"):
        history = train(tiny(run, resume=True))
    assert history == before, "resumed from the recovered checkpoint, not restarted from iteration 1"
    assert rows(run) == before
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")], "orphaned temp folders are removed"


def test_a_save_killed_between_its_renames_is_finished_on_the_next_start(tmp_path, monkeypatch):
    from textgym.files import recover_folder, save_folder_atomically

    out = tmp_path / "ckpt"
    save_folder_atomically(out, lambda d: (d / "v.txt").write_text("1"))
    rename = os.rename

    def killed_before_the_second_rename(src, dst):
        if Path(dst) == out:
            raise KeyboardInterrupt
        rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_before_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        save_folder_atomically(out, lambda d: (d / "v.txt").write_text("2"))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.new", ".ckpt.old"]  # no OUT: the crash state
    assert "finished the interrupted swap" in recover_folder(out)
    assert (out / "v.txt").read_text() == "2" and [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert recover_folder(out) is None


@pytest.mark.parametrize("missing", ["checkpoint", "checkpoint/state.json"])
def test_resume_without_a_loadable_checkpoint_is_an_error_not_a_restart(run, missing):
    before = (run / "metrics.jsonl").read_text()
    target = run / missing
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(target))} is missing"):
        train(tiny(run, resume=True))
    assert (run / "metrics.jsonl").read_text() == before


# ---------------------------------------------------------------- 2. strict loads, the run's config
def test_resume_refuses_changes_that_define_the_run(run):
    from textgym.models import DEFAULT_LM

    pattern = r"changes settings that define the run: max_new_tokens: 6 -> 8, model: None -> '.*lm', seed: 0 -> 1; "
    with pytest.raises(ValueError, match=pattern + r".*Only total_episodes, learning_rate, critic_learning_rate"):
        train(tiny(run, resume=True, max_new_tokens=8, model=str(DEFAULT_LM), seed=1))


def test_resume_applies_new_learning_rates_and_says_so(trainer, done_run):
    from textgym.agents.ppo.checkpoint import read_state
    from textgym.agents.ppo.run_folder import check_resume_config

    with pytest.warns(UserWarning, match=r"resume: learning_rate changes from 0.0001 to 0.0003 \(applied\)"):
        check_resume_config(read_state(done_run / "checkpoint")["config"], trainer.cfg)
    trainer.load(done_run / "checkpoint")
    assert [group["lr"] for group in trainer.optimizer.param_groups] == [3e-4, 5e-4]
    assert trainer.iteration_done == 2


def test_a_weights_file_that_does_not_fit_is_refused_before_anything_changes(trainer, run):
    from safetensors.torch import save_file

    save_file({}, run / "checkpoint" / "policy" / "model.safetensors")  # a valid, empty weights file
    critic = {k: v.clone() for k, v in trainer.critic.state_dict().items()}
    with pytest.raises(ValueError, match=r"policy/model\.safetensors does not fit this run's model: missing \["):
        trainer.load(run / "checkpoint")
    assert all(torch.equal(v, trainer.critic.state_dict()[k]) for k, v in critic.items())


# ---------------------------------------------------------------- 3. nothing unpickled but tensors
class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")  # unpickling it creates the marker file


def test_a_crafted_state_file_is_refused_without_running_its_code(trainer, run, tmp_path):
    marker = tmp_path / "code-ran"
    torch.save(
        {"optimizer": _RunsCode(marker), "torch_rng": None, "sampler_rng": None}, run / "checkpoint" / "state.pt"
    )
    with pytest.raises(ValueError, match=r"state\.pt cannot be loaded as tensors only \(torch\.load weights_only=True"):
        trainer.load(run / "checkpoint")
    assert not marker.exists()


# ---------------------------------------------------------------- 4. metrics.jsonl
def test_a_torn_last_metrics_line_is_dropped_with_a_warning(run):
    before = rows(run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"iteration": 3, "rm_sc')  # the disk filled up during the append
    with pytest.warns(UserWarning, match=r"metrics\.jsonl: dropped the torn last line 3"):
        history = train(tiny(run, resume=True))
    assert history == before and rows(run) == before


def test_any_other_bad_metrics_line_names_the_file_and_the_line(run):
    (run / "metrics.jsonl").write_text("{oops\n" + (run / "metrics.jsonl").read_text())
    with pytest.raises(ValueError, match=r"metrics\.jsonl:1: not a JSON metrics row"):
        train(tiny(run, resume=True))


# ---------------------------------------------------------------- 5. the lock, no silent overwrite
def test_a_second_trainer_on_the_same_folder_fails_at_once_naming_the_holder(run):
    from textgym.files import FolderInUseError, lock_folder

    with lock_folder(run):
        with pytest.raises(FolderInUseError, match=rf"out='.*run' is in use by another process \(pid {os.getpid()},"):
            train(tiny(run, resume=True))
    assert not (run / ".lock").exists()
    with lock_folder(run):  # released: it can be taken again
        pass


def test_an_existing_run_is_never_overwritten_without_a_word(run, capsys):
    from textgym.cli import main

    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match=r"already holds a run \(checkpoint, policy, value, metrics\.jsonl\); "
                                              r"pass --resume .* or --overwrite"):  # fmt: skip
        train(tiny(run))
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", "tiny", "--out", str(run)])
    assert exit_.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == before


def test_overwrite_replaces_the_run(run):
    from textgym.cli import main

    main(["train", "--config", "tiny", "--out", str(run), "--total-episodes", "8", "--overwrite"])
    assert [r["iteration"] for r in rows(run)] == [1]
    assert json.loads((run / "checkpoint" / "state.json").read_text())["iteration"] == 1


# ---------------------------------------------------------------- 6. file modes
def test_saved_weights_follow_the_umask(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from textgym.files import save_folder_atomically

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    old = os.umask(0o022)
    try:
        save_folder_atomically(tmp_path / "m", model.save_pretrained)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    assert "model.safetensors" in modes and modes == dict.fromkeys(modes, 0o644)


# ---------------------------------------------------------------- 7. weights stored once
def test_the_hf_folders_share_the_checkpoints_weight_files(done_run):
    from transformers import AutoModelForCausalLM

    for hf, ckpt in (("policy", "policy"), ("value", "critic")):
        a, b = done_run / hf / "model.safetensors", done_run / "checkpoint" / ckpt / "model.safetensors"
        assert a.stat().st_ino == b.stat().st_ino, hf  # one file on disk under two names
    files = [p for p in done_run.rglob("*") if p.is_file()]
    unique = {p.stat().st_ino: p.stat().st_size for p in files}
    weights = sum(p.stat().st_size for p in files if p.name == "model.safetensors")
    assert sum(unique.values()) <= sum(p.stat().st_size for p in files) - weights / 2 + 1
    AutoModelForCausalLM.from_pretrained(done_run / "policy")  # still a plain HF folder


def test_link_files_copies_where_a_link_is_refused(tmp_path, monkeypatch):
    from textgym.files import link_files

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "w.bin").write_bytes(b"123")

    def refuse(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", refuse)
    link_files(tmp_path / "a", tmp_path / "b")
    copy = tmp_path / "b" / "w.bin"
    assert copy.read_bytes() == b"123" and copy.stat().st_ino != (tmp_path / "a" / "w.bin").stat().st_ino


def test_a_run_folder_saved_before_the_env_settings_dataclass_evaluates_and_resumes(run, capsys):
    """Issue 43.3: ``config.json`` and ``policy/textgym_run.json`` as the code before issue 43 wrote them
    (``tests/data/run_before_issue_43``, from ``textgym train --config tiny`` at e3a0687: no ``partner_timeout``, a
    run info without ``max_prompt_tokens``) still evaluate and resume. The weights are this module's run's: the old
    files name the same settings; only the folder, the thread count and the checkpoint interval are the run's own."""
    from textgym.cli import main

    stored = Path(__file__).parent / "data" / "run_before_issue_43"
    old, now = (json.loads(p.read_text()) for p in (stored / "config.json", run / "config.json"))
    assert "partner_timeout" not in old and "partner_timeout" in now
    (run / "config.json").write_text(json.dumps(old | {k: now[k] for k in ("out", "threads", "checkpoint_every")}))
    shutil.copy(stored / "policy" / "textgym_run.json", run / "policy" / "textgym_run.json")
    main(["eval", "--policy", str(run / "policy"), "--episodes", "2", "--num-envs", "2", "--no-progress"])
    out = capsys.readouterr()
    assert "policy:" in out.out and "kl_coef=0.049992" in out.err  # the stored run info's β was read
    train(tiny(run, resume=True, total_episodes=24))
    assert [r["iteration"] for r in rows(run)] == [1, 2, 3]
    assert "partner_timeout" in json.loads((run / "config.json").read_text())  # rewritten in today's format
