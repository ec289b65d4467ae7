"""How much one busy core slows textgym's Python API, by thread count and OpenMP wait policy.

The cases are what a user's script does, run as the README writes them but shorter:

- ``quickstart``: one ``TextRLHF-v0`` env and an ``LMSampler``, one 16-token episode;
- ``vector``: ``collect_episodes`` over a native vector env of 8 slots x 16 tokens;
- ``sb3``: SB3's ``PPO(LMPolicy, ...)`` of the README, ``learn(64)`` (two rollouts and updates);
- ``trainer``: ``train(PPOConfig(**PRESETS["tiny"]))``, a whole tiny run;
- ``smollm2``: ``collect_episodes`` over SmolLM2-135M-Instruct, 8 slots x 16 tokens.

Each configuration runs every case in a fresh process (the wait policy is read when torch loads),
best of 3 (SB3, the trainer and SmolLM2: of 2) after a warm-up; rounds alternate the
configurations, idle and beside a busy-loop process, so both see the same machine. Each process
imports textgym before torch, as a user's script and the CLI do. Printed: each case's seconds, idle
against the fastest idle configuration and busy against the same configuration idle (issue 35's
bounds for the default: 1.1x and 2x). Never asserted::

    python bench/threads_under_load.py [--rounds 1] [--cases quickstart vector sb3 trainer smollm2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASES = ("quickstart", "vector", "sb3", "trainer", "smollm2")
WORK = r"""
import json, sys, tempfile, time
import gymnasium as gym
import textgym  # before torch, as a user's script or the CLI does: its wait policy applies
import torch
from textgym.episodes import collect_episodes
from textgym.policies import LMSampler

cases, threads = sys.argv[1].split(","), int(sys.argv[2])
if threads:
    torch.set_num_threads(threads)


def best(fn, n=3):
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def quickstart():
    env = gym.make("TextRLHF-v0", max_new_tokens=16)
    policy = LMSampler.for_env(env.unwrapped.model, env, seed=0)

    def episode():
        obs, info = env.reset(seed=0)
        done = False
        while not done:
            action, _ = policy.act(obs)
            obs, reward, terminated, truncated, info = env.step(int(action[0]))
            done = terminated or truncated
    return best(episode)


def vector(**kwargs):
    envs = gym.make_vec("TextRLHF-v0", num_envs=8, vectorization_mode="vector_entry_point",
                        autoreset_mode="disabled", max_new_tokens=16, **kwargs)
    policy = LMSampler.for_env(envs.unwrapped.model, envs, seed=0)
    return best(lambda: collect_episodes(envs, policy, seed=0), n=2 if kwargs else 3)


def sb3():
    from stable_baselines3 import PPO
    from textgym.agents.sb3 import KLPenaltyCallback, LMPolicy

    model = PPO(LMPolicy, gym.make("TextRLHF-v0"), ent_coef=0.0, gamma=1.0, n_steps=32, batch_size=32, n_epochs=2,
                learning_rate=3e-5, seed=0)
    return best(lambda: model.learn(64, callback=KLPenaltyCallback()), n=2)


def trainer():
    from textgym.agents.ppo import PPOConfig, train
    from textgym.agents.ppo.config import PRESETS

    def run():
        with tempfile.TemporaryDirectory() as folder:  # threads: the process's count, as a user's would be
            train(PPOConfig(**{**PRESETS["tiny"], "out": folder + "/run", "threads": torch.get_num_threads()}))
    return best(run, n=2)


def smollm2():
    return vector(model="smollm2-135m-instruct", chat_template=True, prompts="review-requests", normalize_reward=False)


out = {case: globals()[case]() for case in cases}
print(json.dumps({**out, "threads": torch.get_num_threads()}))
"""

# name: (torch threads set after import, 0 = leave textgym's default, -1 = every core; environment changes).
# GNU OpenMP spins GOMP_SPINCOUNT times (libgomp's default 300,000) before a waiting thread sleeps: fewer spins
# hand a shared core back sooner (a sleeper is woken ahead of the busy process), more keep the idle machine's pace.
LIBGOMP_DEFAULT = {"GOMP_SPINCOUNT": "300000"}
CONFIGS = {
    "textgym's default (every core, OMP_WAIT_POLICY=PASSIVE)": (0, {}),
    "one core left free, libgomp's wait (the previous default)": (-2, LIBGOMP_DEFAULT),
    "every core, libgomp's wait": (-1, LIBGOMP_DEFAULT),
    **{f"every core, GOMP_SPINCOUNT={n}": (-1, {"GOMP_SPINCOUNT": str(n)}) for n in (1000, 10000, 100000)},
}


def run(cases: list[str], threads: int, env_changes: dict[str, str]) -> dict[str, float]:
    """Seconds per case in a fresh process (``threads`` -1: one per core, -2: one fewer)."""
    cores = len(os.sched_getaffinity(0))
    threads = {-1: cores, -2: max(1, cores - 1)}.get(threads, threads)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(env_changes, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-c", WORK, ",".join(cases), str(threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=3600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(cases: list[str], rounds: int) -> dict[tuple[str, bool], list[dict[str, float]]]:
    """Every configuration's results, idle and beside a busy-loop process, over alternating rounds."""
    results: dict[tuple[str, bool], list[dict[str, float]]] = {(n, b): [] for n in CONFIGS for b in (False, True)}
    for _ in range(rounds):
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for name, (threads, env_changes) in CONFIGS.items():
                    results[(name, busy)].append(run(cases, threads, env_changes))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    return results


def report(results: dict[tuple[str, bool], list[dict[str, float]]], cases: list[str]) -> None:
    """One table per case: seconds idle and busy; idle against the fastest idle configuration (the target for
    textgym's default: within 1.1x) and busy against the same configuration idle (target: within 2x)."""
    median = {key: {c: statistics.median(r[c] for r in rows) for c in [*cases, "threads"]} for key, rows in
              results.items()}  # fmt: skip
    print(f"cores: {len(os.sched_getaffinity(0))}; median of {len(next(iter(results.values())))} round(s)")
    for case in cases:
        best = min(median[(name, False)][case] for name in CONFIGS)
        print(f"\n{case}\n{'configuration':58s} {'threads':>7s} {'idle s':>8s} {'busy s':>8s} {'idle/best':>9s} "
              f"{'busy/idle':>9s}")  # fmt: skip
        for name in CONFIGS:
            idle, busy = median[(name, False)], median[(name, True)]
            print(f"{name:58s} {idle['threads']:7.0f} {idle[case]:8.3f} {busy[case]:8.3f} "
                  f"{idle[case] / best:9.2f} {busy[case] / idle[case]:9.2f}")  # fmt: skip
    print(json.dumps({f"{name} | {'busy' if busy else 'idle'}": rows for (name, busy), rows in results.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds (medians are printed)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="the cases to run")
    args = parser.parse_args()
    report(measure(args.cases, args.rounds), args.cases)


if __name__ == "__main__":
    main()
