"""What running the LM head on the response columns only saves in a PPO iteration (``logits_to_keep``).

One trainer of a preset; its iterations alternate the two ways of the model's own forward (its head
on the last column only, the chunked head of :mod:`textgym.token_logprobs` doing the policy's
tokens; the forward's head on every column of prompt and response, as it once ran), after one
warm-up iteration each, so that load on a shared machine hits both alike.
Both ways give the same logits (tests/test_speed.py). Printed: the median seconds of log π_old +
advantages (``time_advantage``), of the update and of the iteration, and their ratios. Never asserted::

    python bench/head_columns.py --config smollm2-sentiment --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from textgym import token_logprobs  # noqa: E402
from textgym.agents.ppo import PPOConfig, Trainer  # noqa: E402
from textgym.agents.ppo.config import PRESETS  # noqa: E402
from textgym.threads import BENCH_THREADS_HELP, default_threads  # noqa: E402

PHASES = ("time_advantage", "time_update", "seconds")
WAYS = {"response columns": token_logprobs.takes_logits_to_keep, "every column": lambda model: False}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2-sentiment", choices=sorted(PRESETS), help="the preset's work")
    parser.add_argument("--rounds", type=int, default=2, help="timed iterations of each way, alternating")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    parser.add_argument("--threads", type=int, default=default_threads(), help=BENCH_THREADS_HELP)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    seconds: dict[str, dict[str, list[float]]] = {way: {p: [] for p in PHASES} for way in WAYS}
    with tempfile.TemporaryDirectory() as out:
        changes = {
            "out": out,
            "progress": False,
            "precision": args.precision,
            "threads": args.threads,
            "eval_every": 0,
            "samples_every": 0,
            "early_stop_kl": None,
        }  # both ways do every epoch
        cfg = PPOConfig(**{**PRESETS[args.config], **changes})
        trainer = Trainer.create(cfg)
        try:
            for round_ in range(args.rounds + 1):  # round 0: a warm-up of each way
                for way, takes in WAYS.items():
                    token_logprobs.takes_logits_to_keep = takes
                    row = trainer.iteration()
                    row["seconds"] = row["time_rollout"] + row["time_advantage"] + row["time_update"]
                    if round_:
                        for phase in PHASES:
                            seconds[way][phase].append(row[phase])
        finally:
            token_logprobs.takes_logits_to_keep = WAYS["response columns"]
            trainer.close()
    report(args, seconds, cfg)


def report(args: argparse.Namespace, seconds: dict[str, dict[str, list[float]]], cfg: PPOConfig) -> None:
    median = {way: {p: statistics.median(v) for p, v in phases.items()} for way, phases in seconds.items()}
    print(f"{args.config}: {cfg.num_envs} episodes x {cfg.max_new_tokens} tokens, {cfg.ppo_epochs} epochs x "
          f"{cfg.num_minibatches} minibatches, precision {args.precision}, {args.threads} threads, median of "
          f"{args.rounds} alternating iterations per way")  # fmt: skip
    print(f"{'way':18s} " + " ".join(f"{p:>15s}" for p in PHASES))
    for way in WAYS:
        print(f"{way:18s} " + " ".join(f"{median[way][p]:15.2f}" for p in PHASES))
    ratios = " ".join(f"{median['response columns'][p] / median['every column'][p]:15.3f}" for p in PHASES)
    print(f"{'ratio':18s} {ratios}")


if __name__ == "__main__":
    main()
