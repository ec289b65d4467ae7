"""Drive the native vector env (one batched pi_ref forward per step) and collect finished episodes."""

import argparse

import gymnasium as gym
import numpy as np

import textgym  # noqa: F401
from textgym.policies import LMSampler

parser = argparse.ArgumentParser()
parser.add_argument("--num-envs", type=int, default=16)
parser.add_argument("--episodes", type=int, default=32)
args = parser.parse_args()

envs = gym.make_vec("TextRLHF-v0", num_envs=args.num_envs, vectorization_mode="vector_entry_point")
policy = LMSampler.for_env(envs.unwrapped.model, envs)
obs, _ = envs.reset(seed=0)
scores, gold = [], []
while len(scores) < args.episodes:
    actions, _ = policy.act(obs)
    obs, rewards, terminated, truncated, info = envs.step(actions.numpy())
    for i in np.flatnonzero(info.get("_rm_score", [])):
        scores.append(info["rm_score"][i])
        gold.append(info["gold_score"][i])
print(f"{len(scores)} episodes: mean RM score {np.mean(scores):+.3f}, mean gold score {np.mean(gold):+.3f}")
