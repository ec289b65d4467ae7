"""Build preference pairs, train a Bradley-Terry reward model on them, and plug the result in.

The "labeller" here prefers responses that mention the acting; pairs come from samples of the
embedded reference model. python examples/train_reward_model.py [--samples 256]
"""

import argparse
import json
import random
from pathlib import Path

import gymnasium as gym

import textgym  # noqa: F401
from textgym.models import DEFAULT_LM
from textgym.rewards.calibrate import sample_episodes
from textgym.rewards.training import load_pairs, train_reward_model


def labeller(response: str) -> float:
    return float(sum(w in response.lower() for w in ("actor", "acting", "actress", "cast")))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default="runs/acting_rm")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # 1. responses of pi_ref, and pairs judged by the labeller (ties skipped)
    rows = sample_episodes(args.samples, num_envs=min(64, args.samples), reward_model="vader", max_new_tokens=24)
    rng = random.Random(0)
    with (out / "pairs.jsonl").open("w") as f:
        for _ in range(4 * len(rows)):
            a, b = rng.sample(rows, 2)
            if labeller(a["response"]) == labeller(b["response"]):
                a = {**a, "response": a["response"] + " The acting was good."}  # make a clear preference
            hi, lo = (a, b) if labeller(a["response"]) > labeller(b["response"]) else (b, a)
            f.write(json.dumps({"prompt": "", "chosen": hi["prompt"] + hi["response"],
                                "rejected": lo["prompt"] + lo["response"]}) + "\n")  # fmt: skip

    # 2. train (the same function as `textgym rm-train`)
    result = train_reward_model(load_pairs(out / "pairs.jsonl"), DEFAULT_LM, out / "rm", epochs=args.epochs,
                                lr=3e-4, progress=False)  # fmt: skip
    print(f"held-out pairwise accuracy {result.val_accuracy:.3f} on {result.val_pairs} pairs")

    # 3. plug it in
    env = gym.make("TextRLHF-v0", reward_model=str(out / "rm"), normalize_reward=False)
    env.reset(seed=0)
    info = env.step(env.unwrapped.eos_token_id)[4]
    rm = env.unwrapped.reward_model
    print(f"plugged in: {rm.name}, shares tokenizer: {rm.shares_tokenizer}, empty reply: {info['rm_score']:+.3f}")


if __name__ == "__main__":
    main()
