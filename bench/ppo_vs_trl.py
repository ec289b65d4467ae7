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

A real model (issue "Real models at the hardware limit"): ``--config smollm2-sentiment`` takes that
preset's work on both sides: SmolLM2-135M-Instruct as policy and π_ref, its review requests put
through the chat template by the env's own encoder (TRL gets the same token ids), 16 episodes x 48
tokens, the preset's 2 epochs x 4 minibatches, β = 0.05 fixed (the preset's early stop on KL is off,
so both sides do every epoch). Value model: SmolLM2 with a scalar head on both sides (textgym's
critic copies the policy's body when the RM has another tokenizer). Reward model: textgym pays the
embedded 3.7M RM on the decoded response; TRL needs one over the policy's tokens, so it gets a
model of the embedded RM's shape with SmolLM2's vocabulary (random weights: only its cost matters
here). ``--lora-rank 16`` trains LoRA adapters on both sides (TRL's ``peft_config``, all linear
layers, alpha 32; TRL then drops its separate π_ref copy, as textgym does).

    python bench/ppo_vs_trl.py --config smollm2-sentiment --iterations 2 --rounds 1 --trl bf16 fp32-no-ckpt
    python bench/ppo_vs_trl.py --config smollm2-sentiment --lora-rank 16 --iterations 2 --rounds 1 --trl bf16

On a GPU (``bench/gpu_smoke.sh``): ``--device cuda`` puts both sides there (TRL without ``use_cpu``), and
``--trl-python current`` runs TRL's worker in this interpreter (a machine with TRL installed beside textgym
and no registry to build ``.venv-trl`` from).
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
if "--trl-worker" not in sys.argv:  # textgym's side: imported before torch, as in a user's run (its OpenMP wait,
    import textgym  # noqa: F401  set in os.environ, also reaches TRL's worker process: the same on both sides)

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "textgym" / "assets"
TRL_VENV = Path(os.environ.get("TEXTGYM_TRL_VENV", ROOT / ".venv-trl"))
TRL_PINS = ("torch==2.13.0", "trl==1.12.0", "peft")  # peft: TRL's peft_config (--lora-rank)
# TRL's PPOConfig turns gradient checkpointing on by default, and with it the policy generates without a KV
# cache (use_cache=False): the recipe as given, the recipe with bf16=True, and the recipe with checkpointing off.
TRL_VARIANTS = {"fp32": (False, False), "bf16": (True, False), "fp32-no-ckpt": (False, True)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, choices=("smollm2-sentiment",),
                        help="a train preset whose work both sides do (default: the embedded work)")  # fmt: skip
    parser.add_argument("--lora-rank", type=int, default=None, help="train LoRA adapters of this rank on both sides")
    parser.add_argument("--episodes", type=int, default=None, help="episodes per iteration (64, or the preset's)")
    parser.add_argument("--tokens", type=int, default=None, help="max new tokens per episode (32, or the preset's)")
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)  # the worker's JSON: model folder, prompt ids
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per run (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of every configuration")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),  # the TRL venv has no textgym
                        help="torch threads on both sides (default: every core of this process, textgym's default "
                        "count when it is imported before torch)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="8 episodes x 8 tokens, 1 iteration, 1 round")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both sides run (default cpu)")
    parser.add_argument("--trl-python", default=None, help="the interpreter of TRL's worker: 'current' for this one "
                        "(default: .venv-trl, made on first use)")  # fmt: skip
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl", nargs="+", choices=sorted(TRL_VARIANTS), default=sorted(TRL_VARIANTS),
                        help="TRL configurations to time (default: all)")  # fmt: skip
    parser.add_argument("--textgym", nargs="+", choices=("fp32", "auto"), default=["fp32", "auto"],
                        help="textgym precisions to time (default: both; auto: bf16 where the CPU has it)")  # fmt: skip
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    preset = _preset(args.config)
    args.episodes = args.episodes or preset.get("num_envs", 64)
    args.tokens = args.tokens or preset.get("max_new_tokens", 32)
    args.epochs, args.minibatches = preset.get("ppo_epochs", 4), preset.get("num_minibatches", 4)
    if args.quick:
        args.episodes, args.tokens, args.iterations, args.rounds = 8, 8, 1, 1
    if args.episodes % args.minibatches:
        args.minibatches = 1
    return args


def _preset(name: str | None) -> dict:
    """The preset's settings (read as JSON: the TRL worker's venv has no textgym), or {} for the embedded work."""
    if name is None:
        return {}
    return json.loads((ROOT / "agents" / "ppo" / "presets" / f"{name}.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------------- TRL side (runs in .venv-trl)
def trl_models(work: dict | None) -> dict:
    """TRL's models, every one in float32: the embedded assets (a copy of the RM is the value model), or for a
    preset's ``work`` its model as policy, π_ref (none with LoRA) and value model, and an RM of the embedded
    RM's shape over the policy's vocabulary.

    Why float32: the assets are stored in float16 and transformers 5 loads the stored dtype by default;
    float16 matmuls on the CPU are over 10x slower, which made TRL look 14x slower than it is. textgym
    keeps float32 weights too (``bf16=True`` then autocasts over them on both sides).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if work is None:
        lm = partial(AutoModelForCausalLM.from_pretrained, ASSETS / "lm", dtype=torch.float32)
        rm = partial(AutoModelForSequenceClassification.from_pretrained, ASSETS / "rm", num_labels=1,
                     dtype=torch.float32)  # fmt: skip
        return {"model": lm(), "ref_model": lm(), "reward_model": rm(), "value_model": rm()}
    lm = partial(AutoModelForCausalLM.from_pretrained, work["model"], dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(work["model"], num_labels=1, dtype=torch.float32)
    value.config.pad_token_id = work["pad_id"]
    rm_config = AutoConfig.from_pretrained(ASSETS / "rm", num_labels=1)
    rm_config.vocab_size, rm_config.pad_token_id = work["vocab_size"], work["pad_id"]
    torch.manual_seed(0)
    reward = AutoModelForSequenceClassification.from_config(rm_config, dtype=torch.float32)
    return {"model": lm(), "ref_model": None if work["lora_rank"] else lm(), "reward_model": reward,
            "value_model": value}  # fmt: skip


def _trl_data(work: dict | None, n: int):
    """The tokenizer and ``n`` prompts' token ids: the embedded ones, or the preset's as the env encoded them."""
    from transformers import AutoTokenizer

    if work is None:
        tok = AutoTokenizer.from_pretrained(ASSETS / "lm", padding_side="left")
        prompts = (ASSETS / "data" / "prompts_train.txt").read_text(encoding="utf-8").splitlines()
        return tok, [tok(prompts[i % len(prompts)])["input_ids"] for i in range(n)]
    tok = AutoTokenizer.from_pretrained(work["model"], padding_side="left")
    if tok.pad_token_id is None:
        tok.pad_token_id = work["pad_id"]
    return tok, work["prompt_ids"][:n]


def trl_worker(args: argparse.Namespace) -> None:
    """Train TRL's PPO for 1 + ``iterations`` steps; print one JSON line of the timed steps' seconds."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.manual_seed(0)
    work = json.loads(Path(args.work).read_text(encoding="utf-8")) if args.work else None
    n = args.episodes * (args.iterations + 1)
    tok, rows = _trl_data(work, n)
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *_a, **_k):
            stamps.append(time.perf_counter())

    config = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-ppo-"), use_cpu=args.device == "cpu",
        per_device_train_batch_size=args.episodes,
        num_mini_batches=args.minibatches, num_ppo_epochs=args.epochs, response_length=args.tokens,
        temperature=1.0, kl_coef=0.05, stop_token="eos", num_sample_generations=0, report_to="none",
        total_episodes=n, bf16=args.bf16, save_strategy="no", seed=0, gradient_checkpointing=not args.no_checkpointing,
    )  # fmt: skip
    peft = {}
    if args.lora_rank:
        from peft import LoraConfig

        peft["peft_config"] = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                                         target_modules="all-linear", task_type="CAUSAL_LM")  # fmt: skip
    trainer = PPOTrainer(args=config, processing_class=tok, **trl_models(work), **peft,
                         train_dataset=Dataset.from_dict({"input_ids": rows}), callbacks=[Stamp()])  # fmt: skip
    torch.set_num_threads(args.threads)  # accelerate may have set its own count while the trainer was built
    trainer.train()
    print(json.dumps({"seconds": [b - a for a, b in zip(stamps, stamps[1:])], "threads": torch.get_num_threads()}))


def ensure_trl_venv() -> Path:
    """``.venv-trl/bin/python`` with TRL 1.12 and the pinned torch, made on first use."""
    python = TRL_VENV / "bin" / "python"
    if python.exists():
        if subprocess.run([str(python), "-c", "import peft"], capture_output=True).returncode:  # an older venv
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", *TRL_PINS], check=True)
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
    cmd += ["--threads", str(args.threads), "--device", args.device]
    if args.config is not None:
        cmd += ["--config", args.config, "--work", args.work]
    if args.lora_rank:
        cmd += ["--lora-rank", str(args.lora_rank)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  (TRL ran with {result['threads']} torch threads)", flush=True)
    return result["seconds"]


# ---------------------------------------------------------------------- textgym side
def textgym_config(args: argparse.Namespace, precision: str):
    """The PPOConfig of textgym's side: the embedded work, or the preset's with the bench's episodes, tokens and
    epochs, β fixed and no early stop on KL (TRL does every epoch)."""
    from textgym.agents.ppo import PPOConfig

    preset = {k: v for k, v in _preset(args.config).items() if k != "out"}
    preset.update(total_episodes=args.episodes * (args.iterations + 1), num_envs=args.episodes,
                  max_new_tokens=args.tokens, temperature=1.0, kl_coef=0.05, target_kl=None, early_stop_kl=None,
                  ppo_epochs=args.epochs, num_minibatches=args.minibatches, precision=precision, device=args.device,
                  out="/tmp/textgym-bench-trl", progress=False, threads=args.threads)  # fmt: skip
    if args.lora_rank:
        preset["lora_rank"] = args.lora_rank
    return PPOConfig(**preset)


def run_textgym(args: argparse.Namespace, precision: str) -> tuple[list[float], dict[str, float]]:
    """Seconds of the timed iterations, and their mean split (rollout, π_old + advantages, update)."""
    from textgym.agents.ppo import Trainer

    trainer = Trainer.create(textgym_config(args, precision))
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


def write_work(args: argparse.Namespace, path: Path) -> None:
    """The preset's model folder and its prompts' token ids as the env encodes them, for the TRL worker."""
    import gymnasium as gym

    from textgym.named_models import resolve_named_model

    cfg = textgym_config(args, "fp32")
    env = gym.make(cfg.env_id, **cfg.env_kwargs()).unwrapped
    n = args.episodes * (args.iterations + 1)
    prompt_ids = env.encode_prompts([env.prompts[i % len(env.prompts)] for i in range(n)])  # the ids π_ref is fed
    vocab = int(env.model.get_output_embeddings().weight.shape[0])
    work = {"model": resolve_named_model(cfg.model), "prompt_ids": prompt_ids, "pad_id": env.pad_token_id,
            "vocab_size": vocab, "lora_rank": args.lora_rank}  # fmt: skip
    env.close()
    path.write_text(json.dumps(work), encoding="utf-8")


def main() -> None:
    args = parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    import tempfile

    python = Path(sys.executable) if args.trl_python == "current" else ensure_trl_venv()
    with tempfile.TemporaryDirectory(prefix="ppo-vs-trl-") as tmp:
        if args.config is not None:
            args.work = str(Path(tmp) / "work.json")
            write_work(args, Path(args.work))
        runs, splits = alternate(args, python)
    report(args, runs, splits)


def alternate(args: argparse.Namespace, python: Path) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Every configuration once per round, the order reversed every other round (load hits all alike)."""
    import torch

    from textgym.models import native_bf16

    auto = "bf16" if native_bf16(torch.device(args.device)) else "fp32"
    runs: dict[str, list[float]] = {}
    splits: dict[str, dict[str, float]] = {}
    configs = [(f"textgym {p}" if p == "fp32" else f"textgym auto ({auto})", p) for p in args.textgym]
    configs += [(f"TRL {variant}", variant) for variant in args.trl]
    for r in range(args.rounds):
        for name, setting in configs if r % 2 == 0 else configs[::-1]:
            if name.startswith("TRL"):
                times = run_trl(python, args, setting)
            else:
                times, splits[name] = run_textgym(args, setting)
            runs.setdefault(name, []).extend(times)
            print(f"round {r + 1}: {name:<22} {statistics.median(times):.3f} s/iteration", flush=True)
    return runs, splits


def report(args: argparse.Namespace, runs: dict[str, list[float]], splits: dict[str, dict[str, float]]) -> None:
    import torch

    work = f"{args.config or 'embedded models'}{f', LoRA rank {args.lora_rank}' if args.lora_rank else ''}"
    print(f"\nPPO iteration ({work}), {args.episodes} episodes x {args.tokens} tokens, {args.epochs} epochs x "
          f"{args.minibatches} minibatches, {args.device}, torch threads {torch.get_num_threads()}, median of "
          f"{args.rounds} x {args.iterations}")  # fmt: skip
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
