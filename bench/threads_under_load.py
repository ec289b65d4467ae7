"""How much a busy core slows textgym from Python, by OpenMP wait policy and thread count.

Each configuration runs the same work in a fresh process (the wait policy is read when torch
loads): ``collect_episodes`` on the default env, 16 slots × 16 tokens, best of 3 after a warm-up.
Rounds alternate the configurations, idle and beside a busy-loop process, so both see the same
machine; the ratios are against the idle run of the same configuration and against the idle
2-thread default. Printed, never asserted::

    python bench/threads_under_load.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORK = r"""
import json, sys, time
import gymnasium as gym, torch
import textgym
from textgym.episodes import collect_episodes
from textgym.policies import LMSampler
torch.set_num_threads(int(sys.argv[1]))
envs = gym.make_vec("TextRLHF-v0", num_envs=16, vectorization_mode="vector_entry_point",
                    autoreset_mode="disabled", max_new_tokens=16)
policy = LMSampler.for_env(envs.unwrapped.model, envs, seed=0)
collect_episodes(envs, policy, seed=0)
times = []
for i in range(3):
    start = time.perf_counter()
    collect_episodes(envs, policy, seed=i)
    times.append(time.perf_counter() - start)
print(json.dumps(min(times)))
"""

CONFIGS = {  # name: (threads, environment changes); the first is the reference
    "2 threads, GNU OpenMP's default (spin)": (2, {}),
    "2 threads, OMP_WAIT_POLICY=PASSIVE": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2 threads, GOMP_SPINCOUNT=3000": (2, {"GOMP_SPINCOUNT": "3000"}),
    "1 thread": (1, {}),
}


def run(threads: int, env_changes: dict[str, str]) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(env_changes, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, "-c", WORK, str(threads)], env=env, capture_output=True, text=True,
                         check=True, timeout=900)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (medians are printed)")
    args = parser.parse_args()
    seconds: dict[tuple[str, bool], list[float]] = {(name, busy): [] for name in CONFIGS for busy in (False, True)}
    for _ in range(args.rounds):
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for name, (threads, env_changes) in CONFIGS.items():
                    seconds[(name, busy)].append(run(threads, env_changes))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    median = {key: statistics.median(v) for key, v in seconds.items()}
    reference = median[(next(iter(CONFIGS)), False)]
    print(f"collect_episodes, 16 slots x 16 tokens, best of 3, median of {args.rounds} rounds; cores: "
          f"{len(os.sched_getaffinity(0))}")  # fmt: skip
    print(f"{'configuration':42s} {'idle s':>8s} {'busy s':>8s} {'busy/idle':>9s} {'busy/ref idle':>13s}")
    for name in CONFIGS:
        idle, busy = median[(name, False)], median[(name, True)]
        print(f"{name:42s} {idle:8.3f} {busy:8.3f} {busy / idle:9.2f} {busy / reference:13.2f}")
    print(json.dumps({f"{name} | {'busy' if busy else 'idle'}": v for (name, busy), v in seconds.items()}))


if __name__ == "__main__":
    main()
