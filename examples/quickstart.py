"""Roll one episode of TextRLHF-v0 with the reference policy and read the last step's info."""

import gymnasium as gym

import textgym  # noqa: F401  (registers TextRLHF-v0)
from textgym.policies import LMSampler

env = gym.make("TextRLHF-v0")
policy = LMSampler.for_env(env.unwrapped.model, env, seed=0)  # pi_ref sampling with its own KV cache, seeded
obs, info = env.reset(seed=0)  # the prompt
done = False
while not done:
    action, logprob = policy.act(obs)
    obs, reward, terminated, truncated, info = env.step(int(action[0]))
    done = terminated or truncated
print(f"{info['prompt']!r} -> {info['response']!r}")
print(f"rm_score {info['rm_score']:+.3f}  gold_score {info['gold_score']:+.3f}  last reward {reward:+.3f}")
