"""How far the sampler's log-probs are from the learner's π_old, per model and precision.

The rollout's cached decode (one token at a time, KV cache) and the update's teacher-forced forward
(the whole sequence at once) compute the same distribution with other kernels; under bf16 autocast
they also round differently. This prints, over the valid tokens of one rollout of the policy (a copy
of π_ref, before any update), the mean and max of |log π_old − log π_sampler| and what the trainer's
truncated importance weights min(π_old/π_sampler, tis_cap) make of it. Printed, never asserted::

    python bench/logprob_mismatch.py [--models default,smollm2-135m-instruct] [--precisions fp32,bf16]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SETTINGS = {  # model name: PPOConfig fields (the embedded model at the demo's shape; SmolLM2 as its preset)
    "default": {"config": "demo", "num_envs": 32, "max_new_tokens": 24},
    "smollm2-135m-instruct": {"config": "smollm2-sentiment", "num_envs": 8, "max_new_tokens": 24},
}


def measure(model: str, precision: str, threads: int) -> dict[str, float]:
    """One rollout and its teacher-forced π_old under ``precision``; the mismatch statistics of the trainer."""
    from textgym.agents.ppo import PPOConfig, Trainer
    from textgym.agents.ppo.advantages import sampler_mismatch, sequence_batch, trim_columns
    from textgym.agents.ppo.config import PRESETS

    s = SETTINGS[model]
    cfg = PPOConfig(**{**PRESETS[s["config"]], "num_envs": s["num_envs"], "max_new_tokens": s["max_new_tokens"],
                       "num_minibatches": 4, "precision": precision, "threads": threads, "progress": False,
                       "out": "/tmp/textgym-bench-mismatch"})  # fmt: skip
    trainer = Trainer.create(cfg)
    start = time.perf_counter()
    episodes = trainer._collect(None, cfg.seed, {})
    data = trim_columns(sequence_batch(episodes), trainer.envs.unwrapped.max_prompt_tokens)
    old = trainer._old_logprobs(data)
    stats = sampler_mismatch(old, data["sample_log_prob"], data["mask"], cfg.tis_cap)
    stats.pop("tis_weight")
    trainer.close()
    return {**stats, "tokens": int(data["mask"].sum()), "seconds": time.perf_counter() - start}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SETTINGS), help=f"comma-separated, of {sorted(SETTINGS)}")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated, of fp32 and bf16")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    print(f"CPU: {platform.processor() or platform.machine()}; torch {torch.__version__}; threads {args.threads}")
    print(f"{'model':24s} {'precision':9s} {'tokens':>6s} {'mean |gap|':>11s} {'max |gap|':>10s} "
          f"{'weight mean':>11s} {'capped':>7s}")  # fmt: skip
    for model in args.models.split(","):
        for precision in args.precisions.split(","):
            r = measure(model, precision, args.threads)
            print(f"{model:24s} {precision:9s} {r['tokens']:6d} {r['logprob_mismatch_mean']:11.2e} "
                  f"{r['logprob_mismatch_max']:10.2e} {r['tis_weight_mean']:11.5f} {r['tis_capped_fraction']:7.4f}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
