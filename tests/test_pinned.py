"""Issue 43: the engine's redesign changes no behaviour. Seeded episodes of every env, both autoreset
modes and both reference scorings, and the first iterations' metrics of the demo, ``arith-grpo`` and
``smollm2-guess-ppo`` presets equal the values stored before it (``tests/data/pins.json``, made by
``python -m tests.pins --write`` on the code before the change).

On the CPU that stored them the values must be identical; on another CPU, whose kernels may sum in
another order, the floats within 1e-5 relative (the tokens, texts, flags and counts still equal).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from tests.pins import PINS, cpu_model

ROOT = Path(__file__).parent.parent


def _differences(stored, now, path="", exact=True, out=None) -> list[str]:
    """Where ``now`` differs from ``stored`` (paths, at most 20)."""
    out = [] if out is None else out
    if len(out) >= 20:
        return out
    if isinstance(stored, dict) and isinstance(now, dict):
        if stored.keys() != now.keys():
            out.append(f"{path}: keys {sorted(stored.keys() ^ now.keys())} differ")
        for k in stored.keys() & now.keys():
            _differences(stored[k], now[k], f"{path}/{k}", exact, out)
    elif isinstance(stored, list) and isinstance(now, list):
        if len(stored) != len(now):
            out.append(f"{path}: length {len(stored)} != {len(now)}")
        for i, (a, b) in enumerate(zip(stored, now, strict=False)):
            _differences(a, b, f"{path}[{i}]", exact, out)
    elif isinstance(stored, float) and isinstance(now, float) and not exact:
        if not (math.isclose(stored, now, rel_tol=1e-5, abs_tol=1e-6) or (math.isnan(stored) and math.isnan(now))):
            out.append(f"{path}: {stored!r} != {now!r}")
    elif stored != now and not (isinstance(stored, float) and isinstance(now, float) and math.isnan(stored)
                                and math.isnan(now)):  # fmt: skip
        out.append(f"{path}: {stored!r} != {now!r}")
    return out


def test_differences_finds_a_changed_float_a_token_and_a_key():
    stored = {"a": [1, 2.0, "x"], "b": {"c": float("nan")}}
    assert _differences(stored, json.loads(json.dumps(stored))) == []
    nudged = {"a": [1, 2.0 + 1e-12, "x"], "b": {"c": float("nan")}}
    assert _differences(stored, nudged) == ["/a[1]: 2.0 != 2.000000000001"]
    assert _differences(stored, nudged, exact=False) == []
    moved = {"a": [3, 2.0, "x"], "b": {}}
    assert sorted(_differences(stored, moved, exact=False)) == ["/a[0]: 1 != 3", "/b: keys ['c'] differ"]


def test_seeded_episodes_and_the_first_iterations_of_three_presets_equal_the_stored_values():
    stored = json.loads(PINS.read_text())
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-m", "tests.pins"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    now = json.loads(done.stdout.strip().splitlines()[-1])
    exact = stored["cpu"] == cpu_model()
    assert set(now) == {"episodes", "demo", "arith-grpo", "smollm2-guess-ppo"}
    assert len(now["demo"]) == len(now["arith-grpo"]) == len(now["smollm2-guess-ppo"]) == 2
    differences = _differences(stored["pins"], now, exact=exact)
    assert not differences, f"{'identical' if exact else 'within 1e-5'} expected ({stored['cpu']}):\n" + "\n".join(
        differences
    )
