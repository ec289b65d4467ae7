"""``report_to``: every metric row, the samples table and the config land in TensorBoard, wandb and MLflow.

wandb runs offline (its ``.wandb`` file read back here) and MLflow writes a ``file:`` store in tmp: no network.
"""

import json
import math
from pathlib import Path

import pytest

from textgym.agents.ppo import PPOConfig, train
from textgym.agents.ppo.config import PRESETS
from textgym.agents.ppo.reporting import check_reporters, metric_name, parse_report_to


def test_report_to_names_are_checked():
    assert parse_report_to("tensorboard") == ("tensorboard",)
    assert parse_report_to(" wandb, mlflow,wandb ") == ("wandb", "mlflow")
    assert parse_report_to("none") == ()
    for bad in ("", "tensorboard,neptune", "none,wandb"):
        with pytest.raises(ValueError, match=r"report_to=.* must be a comma-separated list of tensorboard, wandb"):
            parse_report_to(bad)
    with pytest.raises(ValueError, match=r"report_to='tensorboard,comet' must be"):
        PPOConfig(report_to="tensorboard,comet")


def test_a_missing_backend_is_refused_before_the_run_starts(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"report_to='wandb': wandb is not installed; pip install 'textgym\[report\]'"):
        check_reporters("wandb")


@pytest.fixture
def no_backend_settings(tmp_path, monkeypatch):
    """A new user's shell: no W&B login, no MLflow settings, the working directory a fresh folder."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "MLFLOW_TRACKING_URI",
                 "MLFLOW_ALLOW_FILE_STORE", "MLFLOW_EXPERIMENT_NAME"):  # fmt: skip
        monkeypatch.setenv(name, "")  # recorded, so what the code under test sets is undone after the test too
        monkeypatch.delenv(name)
    for name in ("HOME", "WANDB_CONFIG_DIR", "WANDB_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_wandb_without_a_login_is_refused_in_one_line_before_the_run_folder(no_backend_settings):
    """Issue 37.9: wandb.init raised its own UsageError traceback after the run folder was made."""
    out = no_backend_settings / "run"
    cfg = PPOConfig(**{**PRESETS["tiny"], "out": str(out), "total_episodes": 8, "report_to": "wandb"})
    import wandb

    try:
        with pytest.raises(ValueError, match=r"report_to='wandb': .*`wandb login`.*WANDB_MODE=offline") as err:
            train(cfg)
    finally:
        wandb.teardown()  # the login check set up wandb's process-wide settings under this test's environment
    assert "\n" not in str(err.value) and not out.exists()


def test_mlflow_without_settings_reports_to_a_local_store_in_the_working_directory(no_backend_settings):
    """Issue 37.9: mlflow-skinny failed on MLflow's own default store (SQLite, which it cannot open)."""
    from mlflow.tracking import MlflowClient

    from textgym.agents.ppo.reporting import make_reporter, mlflow_tracking_uri

    reporter = make_reporter("mlflow", no_backend_settings / "run", {"seed": 0})
    reporter.log_row({"iteration": 1, "kl": 0.5})
    reporter.close()
    uri = mlflow_tracking_uri()
    assert uri.startswith(("file:", "sqlite:")) and str(no_backend_settings) in uri
    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("textgym").experiment_id])
    assert run.data.metrics == {"ppo/kl": 0.5}


def test_an_mlflow_store_that_cannot_open_is_refused_in_one_line(no_backend_settings, monkeypatch):
    from textgym.agents.ppo.reporting import check_backends

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (no_backend_settings / "mlruns").as_uri())  # no MLFLOW_ALLOW_FILE_STORE
    with pytest.raises(ValueError, match=r"report_to='mlflow': MLflow cannot open the tracking store 'file:.*"
                       r"MLFLOW_ALLOW_FILE_STORE=true") as err:  # fmt: skip
        check_backends("mlflow")
    assert "\n" not in str(err.value)


def test_metric_names():
    assert metric_name("kl") == "ppo/kl" and metric_name("eval_score") == "eval/score"
    assert metric_name("kl", "grpo") == "grpo/kl" and metric_name("eval_kl", "rloo") == "eval/kl"


@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_a_critic_free_run_reports_under_its_own_algorithm(tmp_path, algo):
    """Issue 37.9: GRPO and RLOO runs logged their curves as ppo/…, mixing them with PPO's in one dashboard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from textgym.agents.ppo.reporting import make_reporter

    reporter = make_reporter("tensorboard", tmp_path, {"algo": algo})
    reporter.log_row({"iteration": 1, "kl": 0.5, "eval_score": 1.0})
    reporter.close()
    tags = EventAccumulator(str(tmp_path / "tensorboard")).Reload().Tags()["scalars"]
    assert set(tags) == {f"{algo}/kl", "eval/score"}


def wandb_records(path: Path) -> list:
    """The protobuf records of an offline run's ``.wandb`` file (a LevelDB-style log of 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of a record split over blocks
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_run(out: Path) -> tuple[dict[int, dict], dict, list[dict]]:
    """(history by step, config, sample tables) of the one offline wandb run under ``out``."""
    (path,) = out.glob("wandb/offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(items["_step"], {}).update(items)
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
    tables = [json.loads(p.read_text()) for p in sorted(path.parent.glob("files/media/table/samples_*.table.json"))]
    return history, config, tables


def same(a, b) -> bool:
    return (isinstance(a, float) and math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12)


def test_rows_samples_and_config_land_in_tensorboard_wandb_and_mlflow(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "textgym-test")
    out = tmp_path / "run"
    cfg = PPOConfig(**{**PRESETS["tiny"], "out": str(out), "samples_every": 1, "num_samples": 3,
                       "report_to": "tensorboard,wandb,mlflow"})  # fmt: skip
    rows = train(cfg)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    config = json.loads((out / "config.json").read_text())
    assert len(rows) == 2 and len(samples) == 6

    history, wb_config, tables = wandb_run(out)
    for row in rows:
        logged = history[row["iteration"]]
        for key, value in row.items():
            if key != "iteration":
                assert same(logged[metric_name(key)], value), key
    assert {k: wb_config[k] for k in config} == config
    assert [t["columns"] for t in tables] == [["iteration", "prompt", "response", "score", "gold_score", "kl"]] * 2
    assert [r[2] for t in tables for r in t["data"]] == [s["response"] for s in samples]

    client = MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "textgym-test"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    for key in rows[0]:
        if key != "iteration":
            history = client.get_metric_history(run.info.run_id, metric_name(key))
            assert [(m.step, m.value) for m in history] == [(r["iteration"], pytest.approx(r[key])) for r in rows]
    assert run.data.params["seed"] == "0" and run.data.params["report_to"] == '"tensorboard,wandb,mlflow"'
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert json.loads((artifacts / "config.json").read_text()) == config
    table = json.loads((artifacts / "samples" / "iteration_000002.json").read_text())
    assert [r[2] for r in table["data"]] == [s["response"] for s in samples[3:]]

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.value for e in events.Scalars("ppo/kl")] == [pytest.approx(r["kl"]) for r in rows]
    assert {"config/text_summary", "samples/text_summary"} <= set(events.Tags()["tensors"])


def test_report_to_none_writes_only_the_run_folder(tmp_path):
    out = tmp_path / "run"
    train(PPOConfig(**{**PRESETS["tiny"], "out": str(out), "total_episodes": 8, "report_to": "none"}))
    assert (out / "metrics.jsonl").read_text().strip() and not (out / "tensorboard").exists()
