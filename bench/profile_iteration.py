"""Where one PPO iteration's time goes on a given preset: phases, and torch.profiler's operator split.

Builds the preset's trainer, runs one untimed warm-up iteration, then profiles one more with
``torch.profiler`` (CPU activities; CUDA too on a GPU). Prints the trainer's own phase timings
(rollout: policy sampling vs the env's π_ref decode and scoring; advantages; update), the share of
self time in matrix products (``aten::mm``/``addmm``/``bmm``/``linear`` kernels: the arithmetic)
against everything else (per-layer overhead: small ops, copies, Python), and the top operators.

Usage::

    python bench/profile_iteration.py --config smollm2-sentiment --num-envs 16 --max-new-tokens 48
    python bench/profile_iteration.py --config tiny        # the embedded model, a smoke run
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from textgym.agents.ppo import PPOConfig, Trainer  # noqa: E402
from textgym.agents.ppo.config import PRESETS  # noqa: E402
from textgym.threads import BENCH_THREADS_HELP, default_threads  # noqa: E402

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mkldnn_linear",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_flash_attention_for_cpu_backward")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="smollm2-sentiment", choices=sorted(PRESETS))
    parser.add_argument("--num-envs", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="fp32")
    parser.add_argument("--lora-rank", type=int, default=None, help="override the preset's (0: every weight)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=15, help="top operators printed")
    parser.add_argument("--threads", type=int, default=default_threads(), help=BENCH_THREADS_HELP)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        changes = {"num_envs": args.num_envs, "total_episodes": 3 * args.num_envs,
                   "max_new_tokens": args.max_new_tokens, "num_minibatches": min(4, args.num_envs),
                   "precision": args.precision, "device": args.device, "out": out, "progress": False,
                   "eval_every": 0, "samples_every": 0, "threads": args.threads}  # fmt: skip
        if args.lora_rank is not None:
            changes["lora_rank"] = args.lora_rank
        trainer = Trainer.create(PPOConfig(**{**PRESETS[args.config], **changes}))
        try:
            trainer.iteration()  # warm-up: allocator, lazy imports, first-call paths
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
            start = time.perf_counter()
            with profile(activities=activities) as prof:
                row = trainer.iteration()
            wall = time.perf_counter() - start
        finally:
            trainer.close()
    print(f"{args.config}: {args.num_envs} episodes x <= {args.max_new_tokens} tokens, precision {args.precision}, "
          f"torch threads {torch.get_num_threads()}, device {args.device}; profiled iteration {wall:.1f} s "
          f"(the profiler adds its own overhead)")  # fmt: skip
    rollout = row["time_rollout"]
    phases = {"policy sampling (cached decode)": row["time_policy_sampling"],
              "env: pi_ref cached decode, RM and gold": rollout - row["time_policy_sampling"],
              "log pi_old + advantages (teacher-forced forwards)": row["time_advantage"],
              "update (epochs x minibatches, forward + backward + AdamW)": row["time_update"]}  # fmt: skip
    total = sum(phases.values())
    for name, seconds in phases.items():
        print(f"  {name:<58} {seconds:8.2f} s {100 * seconds / total:5.1f} %")
    events = prof.key_averages()
    self_total = sum(e.self_cpu_time_total for e in events)
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    print(f"  self CPU time in matrix products / attention kernels: {100 * matmul / self_total:.1f} % "
          f"(the rest: small ops, copies, dispatch)")  # fmt: skip
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
