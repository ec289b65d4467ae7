"""``train(cfg)``: a run from start (or resume) to its last save, around :class:`.trainer.Trainer`.

from textgym.agents.ppo import PPOConfig, train
metrics = train(PPOConfig(total_episodes=512, out="runs/x"))
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch

from textgym.models import resolve_device
from textgym.threads import default_threads, machine_threads

from . import distributed, run_folder
from .config import PPOConfig
from .guards import check_memory
from .trainer import Trainer

__all__ = ["train"]


def train(cfg: PPOConfig, overwrite: bool = False) -> list[dict[str, float]]:
    """Run PPO; writes ``metrics.jsonl``, ``config.json``, TensorBoard events and checkpoints under ``cfg.out``.

    The run folder is locked while training (a second trainer fails at once). An existing run is
    continued only with ``cfg.resume`` and replaced only with ``overwrite``; see
    :func:`.run_folder.check_resume_config` for what a resume may change. Started by torchrun, every
    rank trains (:mod:`.distributed`) and rank 0 alone locks the folder and writes to it. ``cfg.threads``
    is filled in with the thread count the run uses; the caller's thread count and deterministic mode
    are given back however the run ends.
    """
    from tqdm.auto import tqdm

    from .recovery import Boundary, save_on_error
    from .reporting import check_backends, make_reporter

    # every rank checks (rank 0 alone failing would leave the others waiting): a missing W&B login or an
    # MLflow store that cannot open is one line, before the run folder is touched
    check_backends(cfg.report_to)
    check_memory(cfg)  # before OUT is created or any model loads: a batch the machine cannot hold is refused
    out = Path(cfg.out)
    joined = not distributed.initialized()
    distributed.init(resolve_device(cfg.device))
    main = distributed.is_main()
    with _torch_settings_restored(), run_folder.held(out) if main else contextlib.nullcontext():
        trainer, history = _start(out, cfg, overwrite)
        reporter = make_reporter(cfg.report_to, out, cfg.to_dict()) if main else None
        bar = tqdm(total=cfg.num_iterations, initial=trainer.iteration_done, desc=cfg.algo,
                   disable=not (cfg.progress and main))  # fmt: skip
        boundary, failed = None, True
        try:
            while trainer.iteration_done < cfg.num_iterations:
                boundary = Boundary.capture(trainer)  # what the rollout changes: rewound if the iteration fails
                row = trainer.iteration()
                if main:
                    _record(out, trainer, reporter, bar, row)
                history.append(row)
            failed = False
        except Exception as err:
            if main and distributed.world()[1] == 1:  # under torchrun the other ranks are not rewound with it
                bar.close()
                save_on_error(out, trainer, boundary, err)
            raise
        finally:
            bar.close()
            if reporter is not None:
                reporter.close()
            trainer.close()
            if joined:
                distributed.leave(finished=not failed)
    return history


def _start(out: Path, cfg: PPOConfig, overwrite: bool) -> tuple[Trainer, list[dict[str, float]]]:
    """Open the run folder, build the trainer (loading the checkpoint on resume), write the kept metrics and config.

    Under torchrun rank 0 decides about the folder and writes; every rank builds its trainer and
    reads the checkpoint (one machine, or ``out`` on a file system every node sees).
    """
    main = distributed.is_main()
    # rank 0 decides the thread count too (the resumed run's, else the default) and every rank takes it
    history, cfg.threads = distributed.on_main(
        lambda: (run_folder.open_run_folder(out, cfg, overwrite), cfg.threads or default_threads())
    )
    if cfg.threads > machine_threads():
        warnings.warn(f"threads={cfg.threads} is more than the {machine_threads()} cores this process may use: "
                      "the run's numbers are the same, its speed lower", stacklevel=3)  # fmt: skip
    trainer = Trainer.create(cfg, _recorded_scale(out) if history is not None else None)
    if history is not None:
        trainer.load(out / "checkpoint")
        if main:
            _repair_exports(out, trainer)
    elif overwrite and main:
        run_folder.clear_run(out)  # only now that the new run's models have loaded
    history = history or []
    if main:
        run_folder.start_files(out, history, trainer.iteration_done, cfg.to_dict())
    return trainer, history


def _recorded_scale(out: Path) -> dict[str, Any]:
    """The reward scale the resumed run paid (its checkpoint's ``normalize_reward``), as an env override.

    Why: read again, a reward server's ``/health`` may answer another mean/std (or none): the resumed
    iterations would pay scores on another scale than the uninterrupted run. {} for a run saved before it was kept.
    """
    from .checkpoint import read_state

    norm = read_state(out / "checkpoint").get("normalize_reward")
    return {} if norm is None else {"normalize_reward": tuple(norm) if isinstance(norm, list) else norm}


def _repair_exports(out: Path, trainer: Trainer) -> None:
    """Re-export ``policy/`` and ``value/`` when they are not the checkpoint's (a crash during the last save)."""
    stale = run_folder.stale_exports(out, list(trainer.trained()), trainer.run_info())
    if stale:
        warnings.warn(f"{out}: {', '.join(stale)} do not match {out / 'checkpoint'} (a crash during its last save): "
                      "re-exported from the checkpoint", stacklevel=4)  # fmt: skip
        trainer.export(out)


@contextlib.contextmanager
def _torch_settings_restored():
    """The caller's torch thread count and deterministic mode, given back when the run ends (or fails)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _record(out: Path, trainer: Trainer, reporter, bar, row: dict[str, float]) -> None:
    """Rank 0's part of an iteration: evaluation, samples, the metrics row, the reporters, the checkpoint."""
    cfg = trainer.cfg
    if cfg.eval_every and trainer.iteration_done % cfg.eval_every == 0:
        row.update(trainer.evaluate())
    if cfg.samples_every and trainer.iteration_done % cfg.samples_every == 0:
        samples = trainer.samples()
        run_folder.append_samples(out, samples)
        reporter.log_samples(samples)  # a table in each reporter
    run_folder.append_metrics(out, row)
    _log_row(reporter, bar, row)
    last = trainer.iteration_done == cfg.num_iterations
    if last:
        bar.close()  # its final line once, before anything the last save prints
    if last or trainer.iteration_done % cfg.checkpoint_every == 0:
        trainer.save(out)


def _log_row(reporter, bar, row: dict[str, Any]) -> None:
    reporter.log_row(row)
    # the postfix first, then one refresh: a set_postfix after update() drew the last line a second time
    bar.set_postfix(score=f"{row['score']:+.2f}", gold=f"{row['gold_score']:+.2f}", kl=f"{row['kl']:.2f}",
                    refresh=False)  # fmt: skip
    bar.update()
