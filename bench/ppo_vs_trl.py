"""Seconds per PPO iteration: textgym's Trainer against TRL 1.12's PPOTrainer on the same work.

The work (issue "Speed at the hardware limit"): the embedded LM as policy and π_ref, the embedded
reward model as r_φ (and, for TRL, a copy of it as the value model), 64 episodes x up to 32 new
tokens at temperature 1, β = 0.05 fixed, 4 PPO epochs x 4 minibatches, on the CPU.

TRL 1.12 is the last TRL with PPO (``trl.experimental.ppo``); it lives in its own virtualenv
(``.venv-trl``, made on first use with ``torch==2.13.0`` pinned, as in the Makefile), and runs
in a subprocess of this script (``--trl-worker``). TRL's recipe::

    PPOConfig(use_cpu=True, per_device_train_batch_size=64, num_mini_batches=4, num_ppo_epochs=4,
              response_length=32, temperature=1.0, kl_coef=0.05, stop_token="eos",
              num_sample_generations=0, report_to="none")

and an iteration is the time between two ``on_step_end`` callbacks. Every model is loaded in
float32 (the assets are stored in float16 and transformers loads the stored dtype by default;
float16 matmuls on this CPU are over 10x slower than float32, which made TRL look 14x slower than
it is). That config turns gradient checkpointing on (TRL's default), and the policy then
generates without a KV cache; ``--trl`` picks among that recipe (``fp32``), the recipe with
``bf16=True`` (``bf16``: autocast over float32 weights) and the recipe with checkpointing off
(``fp32-no-ckpt``). textgym's iteration is one
``Trainer.iteration()`` (rollout through the env, which also scores every episode with the gold
scorer, TRL does not; log π_old; GAE; update). Each side runs one untimed warm-up iteration, then
``--iterations`` timed ones; the sides alternate over ``--rounds`` rounds, so that load on a shared
machine hits them alike. Printed: the median seconds per iteration of each configuration and the
ratios textgym / TRL (target: <= 0.5). Never asserted.

    python bench/ppo_vs_trl.py                 # 2 rounds x 3 iterations per configuration
    python bench/ppo_vs_trl.py --trl fp32 bf16
    python bench/ppo_vs_trl.py --quick         # 8 episodes x 8 tokens, 1 round: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "textgym" / "assets"
TRL_VENV = Path(os.environ.get("TEXTGYM_TRL_VENV", ROOT / ".venv-trl"))
TRL_PINS = ("torch==2.13.0", "trl==1.12.0")
# TRL's PPOConfig turns gradient checkpointing on by default, and with it the policy generates without a KV
# cache (use_cache=False): the recipe as given, the recipe with bf16=True, and the recipe with checkpointing off.
TRL_VARIANTS = {"fp32": (False, False), "bf16": (True, False), "fp32-no-ckpt": (False, True)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64, help="episodes per iteration (the PPO batch)")
    parser.add_argument("--tokens", type=int, default=32, help="max new tokens per episode")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per run (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of every configuration")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="8 episodes x 8 tokens, 1 iteration, 1 round")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl", nargs="+", choices=sorted(TRL_VARIANTS), default=sorted(TRL_VARIANTS),
                        help="TRL configurations to time (default: all)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.quick:
        args.episodes, args.tokens, args.iterations, args.rounds = 8, 8, 1, 1
    return args


# ---------------------------------------------------------------------- TRL side (runs in .venv-trl)
def trl_models() -> dict:
    """TRL's four models from the embedded assets, every one in float32 (a copy of the RM is the value model).

    Why float32: the assets are stored in float16 and transformers 5 loads the stored dtype by default;
    float16 matmuls on the CPU are over 10x slower, which made TRL look 14x slower than it is. textgym
    keeps float32 weights too (``bf16=True`` then autocasts over them on both sides).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    lm = partial(AutoModelForCausalLM.from_pretrained, ASSETS / "lm", dtype=torch.float32)
    rm = partial(AutoModelForSequenceClassification.from_pretrained, ASSETS / "rm", num_labels=1, dtype=torch.float32)
    return {"model": lm(), "ref_model": lm(), "reward_model": rm(), "value_model": rm()}


def trl_worker(args: argparse.Namespace) -> None:
    """Train TRL's PPO for 1 + ``iterations`` steps; print one JSON line of the timed steps' seconds."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(ASSETS / "lm", padding_side="left")
    prompts = (ASSETS / "data" / "prompts_train.txt").read_text(encoding="utf-8").splitlines()
    n = args.episodes * (args.iterations + 1)
    rows = [tok(prompts[i % len(prompts)])["input_ids"] for i in range(n)]
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            stamps.append(time.perf_counter())

    config = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-ppo-"), use_cpu=True, per_device_train_batch_size=args.episodes,
        num_mini_batches=4 if args.episodes % 4 == 0 else 1, num_ppo_epochs=4, response_length=args.tokens,
        temperature=1.0, kl_coef=0.05, stop_token="eos", num_sample_generations=0, report_to="none",
        total_episodes=n, bf16=args.bf16, save_strategy="no", seed=0, gradient_checkpointing=not args.no_checkpointing,
    )  # fmt: skip
    trainer = PPOTrainer(args=config, processing_class=tok, **trl_models(),
                         train_dataset=Dataset.from_dict({"input_ids": rows}), callbacks=[Stamp()])  # fmt: skip
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # accelerate may have set its own count while the trainer was built
    trainer.train()
    print(json.dumps({"seconds": [b - a for a, b in zip(stamps, stamps[1:])], "threads": torch.get_num_threads()}))


def ensure_trl_venv() -> Path:
    """``.venv-trl/bin/python`` with TRL 1.12 and the pinned torch, made on first use."""
    python = TRL_VENV / "bin" / "python"
    if python.exists():
        return python
    print(f"making {TRL_VENV} with {' '.join(TRL_PINS)} (once; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", TRL_PINS[0]], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", *TRL_PINS], check=True)
    return python


def run_trl(python: Path, args: argparse.Namespace, variant: str) -> list[float]:
    bf16, no_ckpt = TRL_VARIANTS[variant]
    cmd = [str(python), __file__, "--trl-worker", "--episodes", str(args.episodes), "--tokens", str(args.tokens),
           "--iterations", str(args.iterations)] + (["--bf16"] if bf16 else []) + (["--no-checkpointing"] if no_ckpt
                                                                                   else [])  # fmt: skip
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  (TRL ran with {result['threads']} torch threads)", flush=True)
    return result["seconds"]


# ---------------------------------------------------------------------- textgym side
def run_textgym(args: argparse.Namespace, precision: str) -> tuple[list[float], dict[str, float]]:
    """Seconds of the timed iterations, and their mean split (rollout, π_old + advantages, update)."""
    from textgym.agents.ppo import PPOConfig, Trainer

    cfg = PPOConfig(
        total_episodes=args.episodes * (args.iterations + 1), num_envs=args.episodes, max_new_tokens=args.tokens,
        temperature=1.0, kl_coef=0.05, target_kl=None, ppo_epochs=4, num_minibatches=4 if args.episodes % 4 == 0 else 1,
        precision=precision, device="cpu", out="/tmp/textgym-bench-trl", progress=False,
    )  # fmt: skip
    trainer = Trainer.create(cfg)
    trainer.iteration()  # warm-up
    seconds, split = [], {"rollout": 0.0, "pi_old+advantages": 0.0, "update": 0.0}
    for _ in range(args.iterations):
        start = time.perf_counter()
        row = trainer.iteration()
        seconds.append(time.perf_counter() - start)
        for key, col in (("rollout", "time_rollout"), ("pi_old+advantages", "time_advantage"),
                         ("update", "time_update")):  # fmt: skip
            split[key] += row[col] / args.iterations
    trainer.envs.close()
    return seconds, split


def main() -> None:
    args = parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    import torch

    from textgym.models import native_bf16

    python = ensure_trl_venv()
    auto = "bf16" if native_bf16(torch.device("cpu")) else "fp32"
    runs: dict[str, list[float]] = {}
    splits: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        configs = [("textgym fp32", "fp32"), (f"textgym auto ({auto})", "auto")]
        configs += [(f"TRL {variant}", variant) for variant in args.trl]
        for name, setting in configs if r % 2 == 0 else configs[::-1]:
            if name.startswith("TRL"):
                times = run_trl(python, args, setting)
            else:
                times, splits[name] = run_textgym(args, setting)
            runs.setdefault(name, []).extend(times)
            print(f"round {r + 1}: {name:<22} {statistics.median(times):.3f} s/iteration", flush=True)
    report(args, runs, splits)


def report(args: argparse.Namespace, runs: dict[str, list[float]], splits: dict[str, dict[str, float]]) -> None:
    import torch

    print(f"\nPPO iteration, {args.episodes} episodes x {args.tokens} tokens, 4 epochs x 4 minibatches, CPU, "
          f"torch threads {torch.get_num_threads()}, median of {args.rounds} x {args.iterations}")  # fmt: skip
    med = {name: statistics.median(times) for name, times in runs.items()}
    for name, seconds in med.items():
        split = splits.get(name)
        detail = "  (" + ", ".join(f"{k} {v:.2f}" for k, v in split.items()) + ")" if split else ""
        print(f"  {name:<22} {seconds:7.3f} s{detail}")
    for ours in (n for n in med if n.startswith("textgym")):
        for theirs in (n for n in med if n.startswith("TRL")):
            print(f"  ratio {ours} / {theirs}: {med[ours] / med[theirs]:.3f} (target <= 0.5)")


if __name__ == "__main__":
    main()
