"""Train the policy with the TorchRL PPO agent from Python, then evaluate it against pi_ref."""

import argparse

from textgym.agents.evaluate import evaluate, format_eval
from textgym.agents.ppo import PPOConfig, train

parser = argparse.ArgumentParser()
parser.add_argument("--total-episodes", type=int, default=512)
parser.add_argument("--num-envs", type=int, default=32)
parser.add_argument("--max-new-tokens", type=int, default=24)
parser.add_argument("--eval-episodes", type=int, default=64)
parser.add_argument("--out", default="runs/example")
args = parser.parse_args()

cfg = PPOConfig(total_episodes=args.total_episodes, num_envs=args.num_envs, max_new_tokens=args.max_new_tokens,
                out=args.out, learning_rate=3e-4, critic_learning_rate=1e-3)  # fmt: skip
history = train(cfg)
print(f"first iteration score {history[0]['score']:+.3f}, last {history[-1]['score']:+.3f}")
n = min(args.eval_episodes, args.num_envs)
print(
    format_eval("pi_ref", evaluate(None, episodes=args.eval_episodes, num_envs=n, max_new_tokens=args.max_new_tokens))
)
print(format_eval("policy", evaluate(f"{args.out}/policy", episodes=args.eval_episodes, num_envs=n,
                                     max_new_tokens=args.max_new_tokens)))  # fmt: skip
