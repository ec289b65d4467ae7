"""Time one PPO iteration on the default env, split into phases, and print each phase's share.

Phases: policy sampling (the policy's cached forwards), env stepping (π_ref's cached forward
per token and bookkeeping), RM/gold scoring (inside the env, at episode ends), advantages
(one critic forward per sequence + GAE) and the PPO update. Printed, never asserted.

    python bench/ppo_iteration.py [--num-envs 64] [--max-new-tokens 32] [--iterations 3] [--precision auto] [--quick]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from textgym.agents.ppo import PPOConfig, Trainer  # noqa: E402
from textgym.threads import BENCH_THREADS_HELP, default_threads  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-envs", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations (after one warm-up)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="a larger policy/π_ref, e.g. an HF folder")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="PPOConfig.precision (auto: bf16 autocast where the device has native bf16)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--threads", type=int, default=default_threads(), help=BENCH_THREADS_HELP)
    args = parser.parse_args()
    if args.quick:
        args.num_envs, args.max_new_tokens, args.iterations = 8, 8, 1
    cfg = PPOConfig(
        total_episodes=args.num_envs * (args.iterations + 1), num_envs=args.num_envs, device=args.device,
        max_new_tokens=args.max_new_tokens, out="/tmp/textgym-bench", progress=False, model=args.model,
        num_minibatches=4 if args.num_envs % 4 == 0 else 1, precision=args.precision, threads=args.threads,
    )  # fmt: skip
    trainer = Trainer.create(cfg)
    engine = trainer.envs.unwrapped._engine
    scoring = [0.0]
    finish = engine._finish

    def timed_finish(*a, **k):  # RM + gold scoring of the episodes that end
        t = time.perf_counter()
        try:
            return finish(*a, **k)
        finally:
            scoring[0] += time.perf_counter() - t

    engine._finish = timed_finish
    trainer.iteration()  # warm-up
    totals = {"policy sampling": 0.0, "env step (pi_ref)": 0.0, "RM + gold scoring": 0.0, "pi_old + advantages": 0.0,
              "PPO update": 0.0}  # fmt: skip
    tokens = 0.0
    for _ in range(args.iterations):
        scoring[0] = 0.0
        row = trainer.iteration()
        totals["policy sampling"] += row["time_policy_sampling"]
        totals["RM + gold scoring"] += scoring[0]
        totals["env step (pi_ref)"] += row["time_rollout"] - row["time_policy_sampling"] - scoring[0]
        totals["pi_old + advantages"] += row["time_advantage"]  # teacher-forced log pi_old, critic, GAE
        totals["PPO update"] += row["time_update"]
        tokens += row["response_length"] * args.num_envs
    whole = sum(totals.values())
    print(f"PPO iteration: {args.num_envs} episodes x up to {args.max_new_tokens} tokens, device {args.device}, "
          f"precision {args.precision} ({'bf16' if trainer.bf16 else 'fp32'} autocast)")  # fmt: skip
    for name, seconds in totals.items():
        print(f"  {name:<20} {seconds / args.iterations:7.3f} s  {100 * seconds / whole:5.1f} %")
    print(f"  {'total':<20} {whole / args.iterations:7.3f} s")
    print(f"  tokens/s (whole iteration): {tokens / whole:.1f}")


if __name__ == "__main__":
    main()
