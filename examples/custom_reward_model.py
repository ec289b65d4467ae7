"""Plug a user-written reward model into TextRLHF-v0 (as an object and as a "module:attr" string),
then train on it with the PPO agent for a short run and watch its score rise.

    python examples/custom_reward_model.py [--total-episodes 768]
"""

import argparse
import sys

import gymnasium as gym

import textgym  # noqa: F401
from textgym.agents.ppo import PPOConfig, train
from textgym.rewards import Episodes


class FunWords:
    """+1 for every cheerful word in the response (a verifiable reward a user might write)."""

    name = "fun-words"
    shares_tokenizer = False  # not a transformer over the policy tokenizer: the critic starts from the policy
    words = ("fun", "funny", "great", "love", "loved", "happy", "good")

    def score(self, episodes: Episodes) -> list[float]:
        return [float(sum(w.strip(".,!?").lower() in self.words for w in r.split())) for r in episodes.responses]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--total-episodes", type=int, default=768)
    parser.add_argument("--num-envs", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", default="runs/custom_rm")
    args = parser.parse_args()

    # 1. by object
    env = gym.make("TextRLHF-v0", reward_model=FunWords(), normalize_reward=False)
    env.reset(seed=0)
    print("object route: the env's reward model is", env.unwrapped.reward_model.name)

    # 2. by "module:attr" string: this script is importable as a module under its own name
    sys.modules.setdefault("custom_reward_model", sys.modules[__name__])
    env = gym.make("TextRLHF-v0", reward_model="custom_reward_model:FunWords", normalize_reward=False)
    print("string route: the env's reward model is", env.unwrapped.reward_model.name)

    # 3. train on it (PPOConfig.reward_model takes any route as a string)
    cfg = PPOConfig(total_episodes=args.total_episodes, num_envs=args.num_envs, max_new_tokens=args.max_new_tokens,
                    reward_model="custom_reward_model:FunWords", learning_rate=5e-4, critic_learning_rate=1e-3,
                    num_minibatches=2, target_kl=None, out=args.out)  # fmt: skip
    history = train(cfg)
    k = max(1, len(history) // 4)
    first = sum(r["rm_score"] for r in history[:k]) / k
    last = sum(r["rm_score"] for r in history[-k:]) / k
    print(f"fun words per response: first iterations {first:.2f} -> last iterations {last:.2f}")


if __name__ == "__main__":
    main()
