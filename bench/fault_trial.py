"""Fault trial: kill -9 a training run at random moments and at every rename of its saves, resume, compare.

    .venv/bin/python bench/fault_trial.py                       # every rename point + 5 random kills
    .venv/bin/python bench/fault_trial.py --random-kills 20 --seed 1
    .venv/bin/python bench/fault_trial.py --quick               # the last save's policy rename + 1 random kill

A reference run of the ``tiny`` preset (``--episodes`` episodes, a checkpoint every iteration) runs
once uninterrupted. Then each trial trains the same run in a child process that is killed with
SIGKILL, either

* at the k-th ``os.rename`` inside the run folder (every swap step of every save: the temp folder
  becoming ``.NAME.new``, ``NAME`` becoming ``.NAME.old``, ``.NAME.new`` becoming ``NAME``), the
  child killing itself just before that rename, or
* after a random delay (drawn from ``--seed``), wherever the run is then;

and ``textgym train --resume`` (killed again at random in random trials, up to ``--max-kills``)
until it finishes. The finished run must equal the reference: the metrics rows (timing columns
aside), ``samples.jsonl``, ``checkpoint/state.json`` (its config aside), and the SHA-256 of every
weight file in ``checkpoint/``, ``policy/`` and ``value/``, with ``policy/`` and ``value/`` the
checkpoint's own files. Prints one line per trial and exits 1 if any trial differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIMING = ("tokens_per_s", "time_")  # columns that measure the machine, not the run
WEIGHT_FILES = ("checkpoint/policy", "checkpoint/critic", "policy", "value")

# The child: textgym's CLI with os.rename counted inside OUT, and SIGKILL before the KILL_AT-th one.
CHILD = """
import os, signal, sys
out, kill_at = os.path.realpath(sys.argv[1]), int(sys.argv[2])
count, real_rename = [0], os.rename
def rename(src, dst, *args, **kwargs):
    if os.path.realpath(os.fspath(dst)).startswith(out + os.sep):
        count[0] += 1
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    return real_rename(src, dst, *args, **kwargs)
os.rename = rename
import atexit
atexit.register(lambda: print(f"renames={count[0]}", file=sys.stderr))
from textgym.cli import main
main(sys.argv[3:])
"""


def train_args(out: Path, episodes: int, resume: bool) -> list[str]:
    """The ``textgym train`` arguments of the trial's run (the same in the reference and every trial)."""
    run = ["--total-episodes", str(episodes), "--checkpoint-every", "1", "--samples-every", "1", "--threads", "1"]
    return ["train", "--config", "tiny", "--out", str(out), *run, "--no-progress", *(["--resume"] if resume else [])]


def child(out: Path, episodes: int, resume: bool, kill_at: int = 0) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-c", CHILD, str(out), str(kill_at), *train_args(out, episodes, resume)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, kill_after: float | None = None) -> tuple[int, str]:
    """Wait for ``proc`` (SIGKILL it after ``kill_after`` seconds if given); its return code and stderr."""
    try:
        _, err = proc.communicate(timeout=kill_after)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
    return proc.returncode, err


def fingerprint(out: Path) -> dict:
    """What must equal the reference: metrics without timing, samples, state without config, weight hashes."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    state.pop("config")
    hashes = {f"{folder}/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest()
              for folder in WEIGHT_FILES if (out / folder).is_dir()
              for p in sorted((out / folder).glob("*.safetensors"))}  # fmt: skip
    return {
        "metrics": [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows],
        "samples": (out / "samples.jsonl").read_text(),
        "state": state,
        "weights": hashes,
        "run_info": json.loads((out / "policy" / "textgym_run.json").read_text()),
    }


def differences(got: dict, want: dict) -> list[str]:
    """The parts of ``got`` that differ from ``want``, plus exported weights that are not the checkpoint's."""
    bad = [key for key in want if got[key] != want[key]]
    for export, ckpt in (("policy", "checkpoint/policy"), ("value", "checkpoint/critic")):
        for name, digest in got["weights"].items():
            if name.startswith(export + "/") and got["weights"].get(name.replace(export, ckpt, 1)) != digest:
                bad.append(f"{name} is not {ckpt}'s")
    return bad


def trial(out: Path, episodes: int, kill_at: int, rng: random.Random, delays: tuple[float, float],
          max_kills: int) -> tuple[int, str]:  # fmt: skip
    """Kill at the ``kill_at``-th rename (0: after a random delay), then resume (random kills too) until done.

    Returns:
        The kills made and the last child's stderr tail.
    """
    shutil.rmtree(out, ignore_errors=True)
    code, err = finish(child(out, episodes, False, kill_at), None if kill_at else rng.uniform(*delays))
    kills = int(code == -signal.SIGKILL)
    while code != 0:
        if code not in (0, -signal.SIGKILL):
            raise RuntimeError(f"the run failed (exit {code}) instead of resuming: {err[-2000:]}")
        kill_after = rng.uniform(*delays) if (not kill_at and kills < max_kills) else None
        code, err = finish(child(out, episodes, True), kill_after)
        kills += code == -signal.SIGKILL
    return kills, err[-400:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=24, help="episodes of the run (8 per iteration)")
    parser.add_argument("--random-kills", type=int, default=5, help="trials killed after random delays")
    parser.add_argument("--max-kills", type=int, default=3, help="kills per random trial (then it may finish)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random delays")
    parser.add_argument("--quick", action="store_true", help="one rename point (the last save's) and 1 random kill")
    parser.add_argument("--out", default=None, help="work folder (default: a temporary one, removed after)")
    args = parser.parse_args()

    work = Path(args.out or tempfile.mkdtemp(prefix="fault_trial_"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    start = time.perf_counter()
    code, err = finish(child(work / "reference", args.episodes, False))
    if code != 0:
        raise SystemExit(f"the reference run failed: {err[-2000:]}")
    want = fingerprint(work / "reference")
    renames = int(err.rsplit("renames=", 1)[1].split()[0])
    seconds = time.perf_counter() - start
    print(f"reference: {len(want['metrics'])} iterations, {renames} renames in its saves, {seconds:.1f} s")
    per_save = 9  # three folders, three renames each once a previous version exists
    # quick: the last save killed just before the policy's temp folder becomes .policy.new (issue 27.1)
    points = [renames - per_save + 4] if args.quick else list(range(1, renames + 1))
    plan = [(k, f"kill at rename {k}/{renames}") for k in points]
    plan += [(0, f"random kills (seed {args.seed}, trial {i})") for i in range(1 if args.quick else args.random_kills)]
    failed = 0
    for kill_at, label in plan:
        kills, _ = trial(work / "trial", args.episodes, kill_at, rng, (1.0, max(2.0, seconds)), args.max_kills)
        bad = differences(fingerprint(work / "trial"), want)
        failed += bool(bad)
        print(f"{label}: {kills} kill(s), then resumed: {'DIFFERS: ' + ', '.join(bad) if bad else 'identical'}")
    print(f"{len(plan) - failed} of {len(plan)} trials identical to the uninterrupted run "
          f"({time.perf_counter() - start:.0f} s)")  # fmt: skip
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
