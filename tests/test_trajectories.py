"""Exact trajectories out (issue 44.2): episodes written as JSONL or Parquet read back as the same tensors."""

import json
import math

import datasets
import pytest
import torch
from test_episodes import Rewarding

from textgym.cli import main
from textgym.episodes import collect_episodes, make_episode_envs
from textgym.policies import LMSampler
from textgym.trajectories import (
    episode_records,
    export_episodes,
    read_episodes,
    read_records,
    trajectory_format,
    write_records,
)

TEXTS = ("prompt", "response", "transcript")


def _collected(env_id: str, n: int = 3, **kwargs):
    envs = make_episode_envs(env_id, n, **kwargs)
    sampler = LMSampler.for_env(envs.unwrapped.model, envs, generator=torch.Generator().manual_seed(0))
    td = collect_episodes(envs, sampler, seed=5)
    envs.close()
    return td


@pytest.fixture(scope="module")
def episodes():
    return {
        "single-turn": _collected("TextRLHF-v0", max_new_tokens=8),
        "conversation": _collected("TextMultiTurn-v0", partner=Rewarding, max_turn_tokens=3, max_new_tokens=40),
        "calculator": _collected("TextMultiTurn-v0", partner="calculator", max_turn_tokens=4, max_new_tokens=24),
    }


def assert_same_episodes(td, back):
    assert set(back.keys()) == set(td.keys()) - {"kept"}
    for key in td.keys():
        if key in TEXTS:
            assert back.get(key).tolist() == td.get(key).tolist(), key
        elif key != "kept":
            assert back[key].dtype == td[key].dtype, key
            # exact, NaN equal to NaN (gold_score and verdict are NaN where the task has none)
            torch.testing.assert_close(back[key], td[key], rtol=0, atol=0, equal_nan=True, msg=key)


@pytest.mark.parametrize("name", ["single-turn", "conversation", "calculator"])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_episodes_read_back_are_the_same_tensors_and_texts(episodes, tmp_path, name, suffix):
    td = episodes[name]
    path = tmp_path / f"episodes{suffix}"
    assert export_episodes(td, path) == len(td)
    assert_same_episodes(td, read_episodes(path))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left beside it


def test_records_are_variable_length_with_training_turn_fields(episodes):
    """OpenEnv's TrainingTurn (openenv 0.10.0) checks these on its four fields: the loss mask covers prompt plus
    completion, the prompt is never trained, one finite log-prob <= 0 per completion token."""
    td = episodes["conversation"]
    P = td["input_ids"].shape[1] - td["action"].shape[1]
    for i, r in enumerate(episode_records(td)):
        prompt, completion, mask = r["prompt_token_ids"], r["completion_token_ids"], r["loss_mask"]
        assert len(prompt) == int(td["attention_mask"][i, :P].sum()) and len(completion) < td["mask"].shape[1]
        assert len(mask) == len(prompt) + len(completion) and set(mask) <= {0, 1} and not any(mask[: len(prompt)])
        assert len(r["per_token_logps"]) == len(completion)
        assert all(math.isfinite(x) and x <= 0 for x in r["per_token_logps"])
        assert sum(mask) == r["response_length"] and r["turn_rewards"][: len(r["turn_ends"])]
        assert [completion[k] for k in r["turn_ends"]] == td["action"][i, r["turn_ends"]].tolist()


def test_datasets_reads_the_jsonl_file_as_written(episodes, tmp_path):
    """What another trainer sees: ``datasets``' own JSON reader gives the same records (a missing gold score is
    null: JSON has no NaN)."""
    td = episodes["single-turn"]
    path = tmp_path / "episodes.jsonl"
    records = episode_records(td)
    records[0]["gold_score"] = math.nan
    write_records(records, path)
    assert json.loads(path.read_text().splitlines()[0])["gold_score"] is None
    mine = read_records(path)
    assert math.isnan(mine[0]["gold_score"])
    theirs = datasets.Dataset.from_json(str(path), cache_dir=str(tmp_path / "cache")).to_list()
    assert theirs[0]["gold_score"] is None
    for a, b in zip(mine, theirs, strict=True):  # JSON's null is our NaN (gold_score, verdict: none)
        assert {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in a.items()} == b


def test_a_bad_format_or_suffix_is_refused_naming_it_and_what_is_allowed(episodes, tmp_path):
    with pytest.raises(ValueError, match=r"path='.*episodes.csv' has the suffix '.csv'.*\['.jsonl', '.parquet'\]"):
        export_episodes(episodes["single-turn"], tmp_path / "episodes.csv")
    with pytest.raises(ValueError, match=r"format='csv' is not a trajectory format; allowed: \['jsonl', 'parquet'\]"):
        export_episodes(episodes["single-turn"], tmp_path / "episodes.jsonl", format="csv")
    assert trajectory_format(tmp_path / "episodes.data", format="parquet") == "parquet"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_failure_mid_write_leaves_no_file_and_keeps_an_old_one(episodes, tmp_path, monkeypatch, suffix):
    """JSONL: the disk fills at the flush, all bytes written; Parquet: the writer fails after half a file."""

    def half_then_fail(self, f, *args, **kwargs):
        f.write(b"PAR1 half a file")
        raise OSError("disk full")

    def full(fd):
        raise OSError("disk full")

    if suffix == ".jsonl":
        monkeypatch.setattr("textgym.files.os.fsync", full)
    else:
        monkeypatch.setattr(datasets.Dataset, "to_parquet", half_then_fail)
    td, path = episodes["single-turn"], tmp_path / f"episodes{suffix}"
    with pytest.raises(OSError, match="disk full"):
        export_episodes(td, path)
    assert list(tmp_path.iterdir()) == []
    path.write_text("old")
    with pytest.raises(OSError, match="disk full"):
        export_episodes(td, path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name] and path.read_text() == "old"


def test_a_number_json_cannot_hold_is_refused_before_writing(episodes, tmp_path):
    records = episode_records(episodes["single-turn"])
    records[1]["rm_score"] = math.inf
    with pytest.raises(ValueError, match=r"record 1 has non-finite numbers in \['rm_score'\].*format='parquet'"):
        write_records(records, tmp_path / "episodes.jsonl")
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_is_not_trajectories_is_refused_naming_it_and_where(episodes, tmp_path):
    path = tmp_path / "episodes.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match=r"path='.*episodes.jsonl': record 0 has the fields \['prompt_token_ids'\]"):
        read_records(path)
    path.write_text("{}\n{not json\n")
    with pytest.raises(ValueError, match=r"path='.*episodes.jsonl': line 2 is not JSON"):
        read_records(path)
    mixed = episode_records(episodes["single-turn"]) + episode_records(episodes["calculator"])
    write_records(mixed, path)
    assert len(read_records(path)) == len(mixed)  # records of two envs are records ...
    with pytest.raises(ValueError, match=r"max_new_tokens takes the values \[8, 24\]; one TensorDict holds episodes"):
        read_episodes(path)  # ... but not one TensorDict
    (tmp_path / "episodes.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"path='.*episodes.parquet' is not a Parquet file of trajectory records"):
        read_records(tmp_path / "episodes.parquet")


def test_cli_writes_n_episodes_of_pi_ref_and_refuses_a_bad_out(tmp_path, capsys):
    out = tmp_path / "pi_ref.parquet"
    main(["trajectories", "--episodes", "3", "--num-envs", "2", "--max-new-tokens", "5", "--seed", "7", "--out",
          str(out)])  # fmt: skip
    assert "wrote 3 episodes of π_ref (TextRLHF-v0)" in capsys.readouterr().out
    td = read_episodes(out)
    assert td.batch_size == torch.Size([3]) and td["action"].shape[1] == 5 and td["mask"].any(1).all()
    with pytest.raises(SystemExit) as stop:
        main(["trajectories", "--episodes", "1", "--out", str(tmp_path / "x.csv")])
    assert stop.value.code == 2
    assert "--out='" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trajectories", "--episodes", "1", "--out", str(out)])
    assert "exists; pass --overwrite" in capsys.readouterr().err


def test_cli_samples_a_saved_policy_in_its_runs_env(tmp_path, capsys):
    """``--policy`` is sampled as ``play`` samples it: in the env its run info names (here 4 tokens, top-k 5)."""
    import shutil

    from textgym.agents.evaluate import RUN_INFO
    from textgym.asset_paths import DEFAULT_LM

    policy = tmp_path / "policy"
    shutil.copytree(DEFAULT_LM, policy)
    (policy / RUN_INFO).write_text(json.dumps({"max_new_tokens": 4, "normalize_reward": False, "top_k": 5}))
    out = tmp_path / "policy.jsonl"
    main(["trajectories", "--policy", str(policy), "--episodes", "2", "--out", str(out)])
    assert f"wrote 2 episodes of {policy} (TextRLHF-v0)" in capsys.readouterr().out
    td = read_episodes(out)
    assert td["action"].shape == (2, 4) and (td["response_length"] <= 4).all()
