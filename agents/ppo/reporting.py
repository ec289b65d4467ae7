"""Where a run's metrics, samples and config go besides its folder: ``report_to="tensorboard,wandb,mlflow"``.

Every reporter gets the same four calls from the trainer (rank 0 only): ``log_config`` once at the start,
``log_row`` after each iteration (step = the iteration), ``log_samples`` when samples are drawn, ``close``
at the end. Metric names are the same everywhere: ``<algo>/<key>`` (``ppo/``, ``grpo/`` or ``rloo/``) for a
``metrics.jsonl`` key and ``eval/<key>`` for its ``eval_<key>`` ones (docs/logging.md maps them to TRL's names).

- ``tensorboard``: event files in ``OUT/tensorboard`` (the default).
- ``wandb``: a Weights & Biases run (project ``$WANDB_PROJECT`` or ``textgym``, named after ``OUT``, files in
  ``OUT/wandb``); ``WANDB_MODE=offline`` keeps it on disk (``wandb sync`` uploads it later).
- ``mlflow``: an MLflow run in ``$MLFLOW_TRACKING_URI``, else a local store in the working directory
  (:func:`mlflow_tracking_uri`), experiment ``$MLFLOW_EXPERIMENT_NAME`` or ``textgym``; the config as
  parameters and ``config.json``, samples as JSON tables under ``samples/``.
- ``none``: only the run folder's own files.

wandb and mlflow are optional (``pip install 'textgym[report]'``) and imported only when asked for.
:func:`check_backends`, called when a run starts, opens each named backend's store or login first, so a
missing login or an unusable store is one line naming the fix, before the run folder is touched.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

REPORTERS = ("tensorboard", "wandb", "mlflow")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # what each one imports
SAMPLE_COLUMNS = ("iteration", "prompt", "response", "score", "gold_score", "kl")

__all__ = ["REPORTERS", "Reporter", "check_backends", "check_reporters", "make_reporter", "metric_name",
           "mlflow_tracking_uri", "parse_report_to"]  # fmt: skip
WANDB_LOCAL_MODES = ("offline", "disabled", "dryrun")  # WANDB_MODE values that need no login


class Reporter(Protocol):
    """What the trainer calls; each backend implements these four."""

    def log_config(self, config: dict[str, Any]) -> None: ...

    def log_row(self, row: dict[str, float]) -> None: ...

    def log_samples(self, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def parse_report_to(text: str) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` as ``("tensorboard", "wandb")``; ``"none"`` as ``()``.

    Raises:
        ValueError: naming ``report_to``, the value and the allowed names.
    """
    names = tuple(dict.fromkeys(n.strip() for n in str(text).split(",") if n.strip()))
    if names == ("none",):
        return ()
    bad = [n for n in names if n not in REPORTERS]
    if bad or not names:
        raise ValueError(f"report_to={text!r} must be a comma-separated list of {', '.join(REPORTERS)}, or 'none'")
    return names


def check_reporters(report_to: str) -> tuple[str, ...]:
    """:func:`parse_report_to`, and each named backend importable (checked before a run folder is touched).

    Raises:
        ValueError: naming ``report_to`` and the extra to install.
    """
    names = parse_report_to(report_to)
    missing = [n for n in names if importlib.util.find_spec(_PACKAGES[n]) is None]
    if missing:
        raise ValueError(f"report_to={report_to!r}: {', '.join(missing)} is not installed; "
                         "pip install 'textgym[report]'")  # fmt: skip
    return names


def check_backends(report_to: str) -> None:
    """Open each backend ``report_to`` names as the run will (a W&B login, an MLflow store), at the run's start.

    Why: ``wandb.init`` without a login and an MLflow store the installed package cannot open fail with a
    library traceback after the run folder exists; checked first, each is one line that names the fix.

    Raises:
        ValueError: naming ``report_to``, what failed and how to fix it.
    """
    names = check_reporters(report_to)
    if "wandb" in names and os.environ.get("WANDB_MODE", "").lower() not in WANDB_LOCAL_MODES:
        import wandb

        if not wandb.login(prompt=False, verify=False):  # credentials from the env, settings or .netrc; no network
            raise ValueError(
                "report_to='wandb': no W&B login found; run `wandb login` (or set WANDB_API_KEY), or set "
                "WANDB_MODE=offline to keep the run on disk (`wandb sync` uploads it later)"
            )
    if "mlflow" in names:
        _mlflow_client()


def mlflow_tracking_uri() -> str:
    """The MLflow store a run reports to: ``$MLFLOW_TRACKING_URI``, else a local one in the working directory.

    MLflow's own default is ``sqlite:///mlflow.db``, which needs SQLAlchemy: the full ``mlflow`` package has
    it, ``mlflow-skinny`` does not and fails on that default. Without SQLAlchemy the local store is MLflow's
    file store ``./mlruns`` (``mlflow ui --backend-store-uri ./mlruns`` shows it).
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    if importlib.util.find_spec("sqlalchemy") is not None:
        return f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    return (Path.cwd() / "mlruns").as_uri()


def _mlflow_client():
    """An ``MlflowClient`` on :func:`mlflow_tracking_uri`.

    Raises:
        ValueError: the store cannot be opened, naming it and the settings that fix it.
    """
    from mlflow.tracking import MlflowClient

    uri = mlflow_tracking_uri()
    if "MLFLOW_TRACKING_URI" not in os.environ and uri.startswith("file:"):
        # textgym's own default: MLflow 3 opens a file store only with this opt-in, which choosing it gives
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    try:
        return MlflowClient(tracking_uri=uri)
    except Exception as err:  # MLflow raises several types here (MlflowException, UnsupportedModelRegistry…)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"report_to='mlflow': MLflow cannot open the tracking store {uri!r} ({reason[:300]}); set "
            "MLFLOW_TRACKING_URI to a server (http://HOST:5000) or a local store (sqlite:///mlflow.db with the full "
            "mlflow package; file:./mlruns with MLFLOW_ALLOW_FILE_STORE=true)"
        ) from None


def metric_name(key: str, algo: str = "ppo") -> str:
    """The name a ``metrics.jsonl`` key is reported under: ``eval/<key>`` for ``eval_<key>``, else ``<algo>/<key>``.

    Why the algorithm: GRPO and RLOO runs beside PPO ones in one dashboard must not share PPO's curves.
    """
    return f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"{algo}/{key}"


def _scalars(row: dict[str, float], algo: str) -> dict[str, float]:
    """A metrics row's values by reported name (the step, ``iteration``, is not a metric)."""
    return {metric_name(k, algo): float(v) for k, v in row.items() if k != "iteration" and isinstance(v, (int, float))}


def _algo(config: dict[str, Any]) -> str:
    """The run's algorithm, the prefix of its metric names (``ppo`` for a config without one)."""
    return str(config.get("algo", "ppo"))


def _sample_table(rows: list[dict[str, Any]]) -> list[list[Any]]:
    return [[r.get(c) for c in SAMPLE_COLUMNS] for r in rows]


def make_reporter(report_to: str, out: str | Path, config: dict[str, Any]) -> Reporter:
    """The reporters ``report_to`` names, as one, with ``config`` already logged to each."""
    reporters = [_BUILDERS[name](Path(out), config) for name in parse_report_to(report_to)]
    reporter = _Fanout(reporters)
    reporter.log_config(config)
    return reporter


class _Fanout:
    """Several reporters as one (each call goes to every one, in order)."""

    def __init__(self, reporters: list[Reporter]):
        self.reporters = reporters

    def log_config(self, config: dict[str, Any]) -> None:
        for r in self.reporters:
            r.log_config(config)

    def log_row(self, row: dict[str, float]) -> None:
        for r in self.reporters:
            r.log_row(row)

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            for r in self.reporters:
                r.log_samples(rows)

    def close(self) -> None:
        for r in self.reporters:
            r.close()


class TensorBoardReporter:
    """Scalars, a markdown samples table and the config as text in ``OUT/tensorboard``."""

    def __init__(self, out: Path, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))
        self.algo = _algo(config)

    def log_config(self, config: dict[str, Any]) -> None:
        # indented four spaces: TensorBoard renders text as markdown, and this keeps the JSON a code block
        self.writer.add_text("config", "\n".join("    " + line for line in json.dumps(config, indent=2).splitlines()))

    def log_row(self, row: dict[str, float]) -> None:
        for name, value in _scalars(row, self.algo).items():
            self.writer.add_scalar(name, value, row["iteration"])

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        table = ["| prompt | response | score | gold | KL |", "|---|---|---|---|---|"]
        table += [f"| {r['prompt']!r} | {r['response']!r} | {r['score']:+.2f} | {r['gold_score']:+.2f} | "
                  f"{r['kl']:.2f} |" for r in rows]  # fmt: skip
        self.writer.add_text("samples", "\n".join(table), rows[0]["iteration"])

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    """A Weights & Biases run: scalars at step = iteration, a ``samples`` table, the config as the run's config."""

    def __init__(self, out: Path, config: dict[str, Any]):
        import wandb

        self.wandb, self.algo = wandb, _algo(config)
        (out / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "textgym"), name=out.resolve().name,
                              dir=str(out), config=config, reinit="create_new")  # fmt: skip

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_row(self, row: dict[str, float]) -> None:
        self.run.log(_scalars(row, self.algo), step=int(row["iteration"]))

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=_sample_table(rows))
        self.run.log({"samples": table}, step=int(rows[0]["iteration"]))

    def close(self) -> None:
        self.run.finish()


class MLflowReporter:
    """An MLflow run through ``MlflowClient`` (no global active run: a caller's own run is left alone)."""

    def __init__(self, out: Path, config: dict[str, Any]):
        self.client, self.algo = _mlflow_client(), _algo(config)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "textgym")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=out.resolve().name).info.run_id

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # parameters are strings of bounded length; the exact config is the config.json artifact
        params = [Param(k, json.dumps(v)[:500]) for k, v in config.items()]
        self.client.log_batch(self.run_id, params=params)
        self.client.log_dict(self.run_id, config, "config.json")

    def log_row(self, row: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(row["iteration"])
        metrics = [Metric(k, v, now, step) for k, v in _scalars(row, self.algo).items() if math.isfinite(v)]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_samples(self, rows: list[dict[str, Any]]) -> None:
        table = {"columns": list(SAMPLE_COLUMNS), "data": _sample_table(rows)}
        self.client.log_dict(self.run_id, table, f"samples/iteration_{int(rows[0]['iteration']):06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_BUILDERS = {"tensorboard": TensorBoardReporter, "wandb": WandbReporter, "mlflow": MLflowReporter}
