"""A run's folder: the lock, recovery of an interrupted save, the resume decision, metrics and samples files.

``out/`` holds ``metrics.jsonl`` (one JSON row per iteration, appended), ``samples.jsonl``,
``config.json``, ``tensorboard/`` and the folders a save swaps in atomically: ``checkpoint/``
(:mod:`.checkpoint`), ``policy/`` and ``value/`` (its exports). Nothing here knows a file format
inside those folders or how a model trains.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

from textgym.errors import short_repr
from textgym.files import (
    check_own_file,
    check_writable_folder,
    lock_folder,
    open_own_file,
    recover_folder,
    write_text_atomically,
)

from .checkpoint import export_matches, read_state
from .config import RESUME_APPLIED, RESUME_FREE, PPOConfig, field_defaults
from .guards import Stopped, stop_on_sigterm

__all__ = [
    "METRICS",
    "SAMPLES",
    "append_metrics",
    "append_samples",
    "check_resume_config",
    "clear_run",
    "held",
    "open_run_folder",
    "read_metrics",
    "stale_exports",
    "start_files",
]

METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"  # sample completions every `samples_every` iterations
RUN_FOLDERS = ("checkpoint", "policy", "value")  # written with save_folder_atomically
EXPORTS = {"policy": "policy", "value": "critic"}  # exported HF folder -> the checkpoint folder it is made from
REWRITTEN = (METRICS, SAMPLES, "config.json")  # rewritten whole at a (re)start (write_text_atomically)
RUN_FILES = (*REWRITTEN, "tensorboard", *RUN_FOLDERS)  # what --overwrite removes
BEFORE_FIELDS = {"tis_cap": None}  # what a run saved before these fields existed did


# ---------------------------------------------------------------------- holding the folder
@contextlib.contextmanager
def held(out: Path):
    """Hold ``out`` for a run: writable, locked, SIGTERM raised as :class:`Stopped`, and a stop reported."""
    check_writable_folder(out, "out")
    with stop_on_sigterm(), lock_folder(out, "out"):
        try:
            yield
        except KeyboardInterrupt as err:
            _report_stop(out, err)
            raise


def _report_stop(out: Path, err: KeyboardInterrupt) -> None:
    """Say on stderr what the run folder holds after a SIGTERM or Ctrl-C: the checkpoint a resume continues from."""
    name = "SIGTERM" if isinstance(err, Stopped) else "SIGINT"
    _recover(out)  # a stop during a save: finish or undo its swap first
    try:
        saved = read_state(out / "checkpoint")["iteration"]
        note = (f"the checkpoint in {out / 'checkpoint'} holds iteration {saved}; --resume continues from it "
                "(the iterations after it run again)")  # fmt: skip
    except (OSError, ValueError):
        note = f"no checkpoint was saved in {out}; start the run again (--overwrite)"
    print(f"textgym: stopped by {name}; {note}", file=sys.stderr)


# ---------------------------------------------------------------------- the resume decision
def open_run_folder(out: Path, cfg: PPOConfig, overwrite: bool) -> list[dict[str, Any]] | None:
    """Decide, before any model loads, how the run in ``out`` goes on; refuse whatever would lose or mix it up.

    Returns:
        The metrics rows to keep when resuming, None when starting a new run.
    """
    if cfg.resume and overwrite:
        raise ValueError(
            f"resume=True and overwrite=True for out={cfg.out!r}: continue the run or replace it, not both"
        )
    _recover(out)
    _check_own_entries(out)
    found = _holds_run(out)
    if overwrite or not found:
        return None
    if not cfg.resume:
        raise FileExistsError(
            f"out={cfg.out!r} already holds a run ({', '.join(found)}); pass --resume (resume=True) to continue "
            "it or --overwrite (train(cfg, overwrite=True)) to replace it"
        )
    if found == [METRICS]:  # stopped before its first save completed: no iteration was kept to continue from
        warnings.warn(f"{out}: no checkpoint was ever saved (the run stopped before its first save): it starts "
                      f"again from iteration 1, replacing {out / METRICS}", stacklevel=3)  # fmt: skip
        return None
    if not (out / "checkpoint").is_dir():
        raise FileNotFoundError(
            f"resume=True but out={cfg.out!r} has no checkpoint ({out / 'checkpoint'} is missing; it holds "
            f"{', '.join(found)}): the run cannot continue where it stopped; pass --overwrite to start it again"
        )
    state = read_state(out / "checkpoint")
    if cfg.threads is None:  # not given: the run's own (None in a run saved before it was recorded)
        cfg.threads = state["config"].get("threads")
    check_resume_config(state["config"], cfg)
    kept = [row for row in read_metrics(out / METRICS) if row["iteration"] <= state["iteration"]]
    if len(kept) != state["iteration"]:
        warnings.warn(f"{out / METRICS} holds {len(kept)} rows for the checkpoint's {state['iteration']} "
                      "iterations; the missing ones are not recovered", stacklevel=3)  # fmt: skip
    return kept


def check_resume_config(saved: dict[str, Any], cfg: PPOConfig) -> None:
    """Refuse a resume that changes what defines the run; warn about the allowed changes it applies.

    A field the saved config lacks (added to ``PPOConfig`` after the run started) counts as its default,
    but for those whose default changed what a run does (``BEFORE_FIELDS``): a run saved before
    ``tis_cap`` existed trained without importance weights, so resuming it asks for ``--tis-cap none``.
    """
    saved = {**field_defaults(), **BEFORE_FIELDS, **saved}
    now = cfg.to_dict()
    if now["threads"] is None:  # not given: the run's own (train() takes it before the models load)
        now["threads"] = saved["threads"]
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k, "<unset>") != now.get(k, "<unset>"))
    refused = [k for k in changed if k not in RESUME_APPLIED + RESUME_FREE]
    if refused:
        listing = ", ".join(f"{k}: {saved.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}" for k in refused)
        raise ValueError(
            f"resume=True for out={cfg.out!r} changes settings that define the run: {listing}; give the run's "
            f"values, another --out, or --overwrite. Only {', '.join(RESUME_APPLIED)} may change (and are applied)"
        )
    for key in (k for k in changed if k in RESUME_APPLIED):
        warnings.warn(f"resume: {key} changes from {saved[key]!r} to {now[key]!r} (applied)", stacklevel=2)


def _holds_run(out: Path) -> list[str]:
    """What in ``out`` belongs to a run worth keeping: metrics rows or saved folders."""
    found = [name for name in RUN_FOLDERS if (out / name).is_dir()]
    metrics = out / METRICS
    if metrics.is_file() and metrics.stat().st_size:
        found.append(METRICS)
    return found


def _recover(out: Path) -> None:
    """Finish or undo the saves a crash interrupted and drop incomplete temp files, each reported as a warning."""
    for name in RUN_FOLDERS:
        if note := recover_folder(out / name):
            warnings.warn(f"{out / name}: {note}", stacklevel=4)
    for name in REWRITTEN:
        tmp = out / f".{name}.tmp"
        if not tmp.is_dir() or tmp.is_symlink():  # unlink removes a link, never its target
            tmp.unlink(missing_ok=True)


def _check_own_entries(out: Path) -> None:
    """Refuse a run file or folder of ``out`` that is a link (or a FIFO, a device): the run would write through it.

    A hard-linked run file (a ``cp -al`` copy of a run) is allowed: the start replaces each whole by a rename.
    """
    for name in REWRITTEN:
        check_own_file(out / name, "out", hard_links=True)
    for name in ("tensorboard", *RUN_FOLDERS):
        check_own_file(out / name, "out", role="folder")


def clear_run(out: Path) -> None:
    """Remove the run files ``--overwrite`` replaces (other files in ``out`` stay)."""
    for name in RUN_FILES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def start_files(out: Path, history: list[dict[str, Any]], iteration: int, config: dict[str, Any]) -> None:
    """At a (re)start: the kept metrics rows and sample rows up to ``iteration``, and the config, rewritten whole."""
    _keep_samples(out, iteration)
    write_text_atomically(out / METRICS, "".join(json.dumps(r) + "\n" for r in history), "out")
    write_text_atomically(out / "config.json", json.dumps(config, indent=2) + "\n", "out")


def stale_exports(out: Path, trained: list[str], run_info: dict[str, Any]) -> list[str]:
    """The exported folders that are not the checkpoint's (a crash during the last save); ``trained``: its models.

    Why: a save swaps in the checkpoint first, then the exports; killed between the two, the run
    resumes from the new checkpoint while ``policy/`` still holds an earlier iteration's weights and β.
    """
    info = {"policy": run_info}  # value/ holds no run info
    ckpt = out / "checkpoint"
    return [folder for folder, name in EXPORTS.items()
            if name in trained and not export_matches(ckpt / name, out / folder, info.get(folder))]  # fmt: skip


# ---------------------------------------------------------------------- metrics and samples
def append_metrics(out: Path, row: dict[str, Any]) -> None:
    with _append(out / METRICS) as f:
        f.write(json.dumps(row) + "\n")


def _append(path: Path):
    """``path`` opened to append, refused if it is a link to another file (:func:`textgym.files.open_own_file`)."""
    return os.fdopen(open_own_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "out"), "a", encoding="utf-8")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``; a torn last line (a crash or a full disk mid-append) is dropped with a warning.

    Raises:
        ValueError: naming the file and line of any other bad row.
    """
    if not path.exists():
        return []
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    last = lines.pop()  # "" when the file ends with a newline, as every complete append does
    rows = [_metrics_row(path, n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    if last.strip():
        try:
            rows.append(_metrics_row(path, len(lines) + 1, last))  # a whole row that lost only its newline
        except ValueError:
            warnings.warn(f"{path}: dropped the torn last line {len(lines) + 1} ({short_repr(last, 60)})", stacklevel=2)
    return rows


def _metrics_row(path: Path, n: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except ValueError as err:
        raise ValueError(f"{path}:{n}: not a JSON metrics row ({err}): {short_repr(line, 60)}") from err
    if not isinstance(row, dict) or not isinstance(row.get("iteration"), int):
        raise ValueError(
            f"{path}:{n}: a metrics row is a JSON object with an int 'iteration', got {short_repr(line, 60)}"
        )
    return row


def append_samples(out: Path, rows: list[dict[str, Any]]) -> None:
    """Append sample completions to ``samples.jsonl``."""
    with _append(out / SAMPLES) as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


def _keep_samples(out: Path, iteration: int) -> None:
    """On resume: drop the sample rows past the checkpoint's iteration (those iterations run again)."""
    path = out / SAMPLES
    if path.is_file():
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        kept = "".join(line + "\n" for line in lines if _sample_iteration(line) <= iteration)
        write_text_atomically(path, kept, "out")


def _sample_iteration(line: str) -> int:
    """The iteration of a ``samples.jsonl`` row; a torn row counts as past every checkpoint (dropped)."""
    try:
        return int(json.loads(line)["iteration"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62
