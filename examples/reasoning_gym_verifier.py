"""An external verifier as the reward model: reasoning-gym's ``score_answer`` on TextArithmetic-v0, offline.

reasoning-gym generates problems with their own checker. Any checker is a reward model in textgym
(a function ``f(prompts, responses) -> floats``), so its problems become the env's prompts and its
``score_answer`` the reward; the env keeps our ``ArithmeticVerifier`` as the gold scorer, so the
two can be compared episode by episode. Then GRPO trains on reasoning-gym's reward.

    pip install reasoning-gym
    python examples/reasoning_gym_verifier.py [--problems 512] [--iterations 400]
"""

import argparse
import re

import gymnasium as gym
import numpy as np
import torch
from reasoning_gym import create_dataset

import textgym  # noqa: F401  (registers TextArithmetic-v0)
from textgym.agents.ppo import PPOConfig, Trainer
from textgym.episodes import collect_episodes
from textgym.policies import LMSampler


def reasoning_gym_task(problems: int, seed: int):
    """reasoning-gym's two-term additions as ``"a+b="`` prompts (the embedded model's format) and their scorer."""
    data = create_dataset("basic_arithmetic", size=problems, seed=seed, min_terms=2, max_terms=2, min_digits=1,
                          max_digits=2, operators=("+",), allow_parentheses=False, allow_negation=False)  # fmt: skip
    entries = {}
    for entry in data:
        a, b = re.findall(r"\d+", entry["question"])
        entries[f"{a}+{b}="] = entry  # "Calculate 37 + 48." -> "37+48="

    def score(prompts: list[str], responses: list[str]) -> list[float]:
        return [float(data.score_answer(r.strip(), entries[p])) for p, r in zip(prompts, responses)]

    return list(entries), score


def accuracy(envs, policy, episodes: int) -> tuple[float, float, float]:
    """π's mean reward under reasoning-gym, under our verifier (gold), and how often the two agree."""
    done = collect_episodes(envs, policy, num_episodes=episodes, seed=0)
    rm, gold = done["rm_score"].numpy(), done["gold_score"].numpy()
    return float(rm.mean()), float(gold.mean()), float(np.mean(rm == gold))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--problems", type=int, default=512)
    parser.add_argument("--iterations", type=int, default=400, help="GRPO iterations of 64 episodes")
    parser.add_argument("--out", default="runs/reasoning-gym")
    args = parser.parse_args()

    prompts, score = reasoning_gym_task(args.problems, seed=0)
    task = {"prompts": prompts, "reward_model": score}
    envs = gym.make_vec("TextArithmetic-v0", num_envs=64, vectorization_mode="vector_entry_point",
                        autoreset_mode="disabled", **task)  # fmt: skip
    ref = LMSampler.for_env(envs.unwrapped.model, envs, generator=torch.Generator().manual_seed(0))
    rm, gold, agree = accuracy(envs, ref, 64)
    print(f"pi_ref: reasoning-gym reward {rm:.3f}, our verifier {gold:.3f}, agreement {agree:.3f}")

    cfg = PPOConfig(env_id="TextArithmetic-v0", algo="grpo", group_size=8, num_envs=64, max_new_tokens=4,
                    total_episodes=64 * args.iterations, kl_coef=0.05, target_kl=None, learning_rate=1e-4,
                    ppo_epochs=2, num_minibatches=2, device="cpu", out=args.out, progress=False)  # fmt: skip
    trainer = Trainer.create(cfg, env_overrides=task)  # the env pays reasoning-gym's score
    for _ in range(args.iterations):
        trainer.iteration()
    policy = LMSampler.for_env(trainer.policy, envs, generator=torch.Generator().manual_seed(0))
    print(
        "after GRPO: reasoning-gym reward {:.3f}, our verifier {:.3f}, agreement {:.3f}".format(
            *accuracy(envs, policy, 64)
        )
    )


if __name__ == "__main__":
    main()
