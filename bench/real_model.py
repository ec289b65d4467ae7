"""A PPO iteration of SmolLM2-135M-Instruct on the sentiment task, with and without LoRA: time split and memory.

Each setting runs in its own process (peak RSS is per process): the ``smollm2-sentiment`` preset
at ``--num-envs`` episodes × ``--max-new-tokens`` tokens, one warm-up iteration, then
``--iterations`` timed ones. Prints seconds per iteration (rollout / update), tokens/s of the
rollout and of the update, and the process's peak RSS. Printed, never asserted.

    python bench/real_model.py [--num-envs 16] [--max-new-tokens 32] [--iterations 2] [--settings 0:3e-6,16:1e-4]

Also prints approx_kl and KL to π_ref of every iteration (warm-up first): the default learning
rate (1e-4) against the rate the preset was first measured at (3e-6; it trains at 1e-5 now) on a 135M model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def one_setting(num_envs: int, max_new_tokens: int, iterations: int, lora_rank: int, lr: float) -> dict:
    from textgym.agents.ppo import PPOConfig, Trainer
    from textgym.agents.ppo.config import PRESETS

    cfg = PPOConfig(**{**PRESETS["smollm2-sentiment"], "num_envs": num_envs, "max_new_tokens": max_new_tokens,
                       "total_episodes": num_envs * (iterations + 1), "num_minibatches": min(4, num_envs),
                       "lora_rank": lora_rank, "learning_rate": lr, "out": "/tmp/textgym-bench-real",
                       "progress": False, "early_stop_kl": None, "warmup_iterations": 0})  # fmt: skip
    start = time.perf_counter()
    trainer = Trainer.create(cfg)
    setup = time.perf_counter() - start
    warmup = trainer.iteration()
    rows = [trainer.iteration() for _ in range(iterations)]
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("time_rollout", "time_update", "tokens_per_s")}
    tokens = sum(r["response_length"] for r in rows) / len(rows) * num_envs
    trainable = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    return {"lora_rank": lora_rank, "learning_rate": lr,
            "approx_kl": [round(r["approx_kl"], 4) for r in (warmup, *rows)],
            "kl": [round(r["kl"], 3) for r in (warmup, *rows)], "setup_s": round(setup, 1),
            "rollout_s": round(mean["time_rollout"], 2),
            "update_s": round(mean["time_update"], 2), "rollout_tokens_per_s": round(tokens / mean["time_rollout"], 1),
            "update_tokens_per_s": round(tokens / mean["time_update"], 1), "trainable_params": trainable,
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument(
        "--settings",
        default="0:3e-6,16:1e-4,0:1e-4",
        help="comma-separated LORA_RANK:LEARNING_RATE (rank 0: every weight trains)",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one setting
    args = parser.parse_args()
    if args.one is not None:
        rank, lr = args.one.split(":")
        print(json.dumps(one_setting(args.num_envs, args.max_new_tokens, args.iterations, int(rank), float(lr))))
        return
    for setting in args.settings.split(","):
        cmd = [sys.executable, __file__, "--one", setting, "--num-envs", str(args.num_envs),
               "--max-new-tokens", str(args.max_new_tokens), "--iterations", str(args.iterations)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
