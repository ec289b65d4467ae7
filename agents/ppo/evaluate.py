"""Evaluate a policy on the eval prompts: RM score, gold score and KL to π_ref (mean ± std)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

import textgym  # noqa: F401
from textgym.envs import load_prompts
from textgym.models import EVAL_PROMPTS, load_causal_lm
from textgym.policies import LMPolicy

__all__ = ["evaluate", "format_eval"]


@torch.no_grad()
def evaluate(
    model: str | None = None,
    *,
    episodes: int = 128,
    num_envs: int = 64,
    seed: int = 1234,
    temperature: float = 1.0,
    device: str = "cpu",
    **env_kwargs,
) -> dict:
    """Sample ``episodes`` responses from ``model`` (default: π_ref itself) on the eval prompts.

    The eval prompts are taken in order (cycled), each env slot sampling at ``temperature``.
    KL to π_ref per sequence is Σ_t log π(a_t|s_t) − log π_ref(a_t|s_t) over the sampled
    tokens (the k1 estimate, unbiased under π).

    Returns:
        ``{"rm_score", "score", "gold_score", "kl", "response_length"}`` each as ``(mean, std)``,
        plus ``"samples"``: the first episodes' prompt, response and scores.
    """
    env_kwargs.setdefault("prompts", str(EVAL_PROMPTS))
    envs = gym.make_vec("TextRLHF-v0", num_envs=num_envs, vectorization_mode="vector_entry_point",
                        device=device, **env_kwargs)  # fmt: skip
    base = envs.unwrapped
    policy_model = base.model if model is None else load_causal_lm(model, device=device, name="model")
    policy = LMPolicy.for_env(policy_model, envs, temperature=temperature,
                              generator=torch.Generator(device=policy_model.device).manual_seed(seed))  # fmt: skip
    prompts = load_prompts(env_kwargs["prompts"])
    rows: list[dict] = []
    while len(rows) < episodes:
        batch = [prompts[(len(rows) + i) % len(prompts)] for i in range(num_envs)]
        obs, _ = envs.reset(seed=seed, options={"prompt": batch})
        policy.reset()
        kl = np.zeros(num_envs)
        done = np.zeros(num_envs, dtype=bool)
        final: list[dict | None] = [None] * num_envs
        while not done.all():
            a, lp = policy.act(obs)
            obs, _, term, trunc, info = envs.step(a.cpu().numpy())
            live = ~done
            kl[live] += lp.cpu().numpy()[live] - info["ref_logprob"][live]
            for i in np.flatnonzero((term | trunc) & live):
                final[i] = {k: info[k][i] for k in ("rm_score", "score_reward", "gold_score", "prompt",
                                                     "response", "response_length")}  # fmt: skip
                final[i]["kl"] = float(kl[i])
            done |= term | trunc
        rows.extend(final)
    rows = rows[:episodes]
    envs.close()

    def stat(key: str) -> tuple[float, float]:
        values = np.array([r[key] for r in rows], dtype=np.float64)
        return float(values.mean()), float(values.std())

    result = {key: stat(src) for key, src in (("rm_score", "rm_score"), ("score", "score_reward"),
                                              ("gold_score", "gold_score"), ("kl", "kl"),
                                              ("response_length", "response_length"))}  # fmt: skip
    result["samples"] = [
        {"prompt": r["prompt"], "response": r["response"], "score": float(r["score_reward"]),
         "gold": float(r["gold_score"]), "kl": float(r["kl"])}
        for r in rows[:8]
    ]  # fmt: skip
    result["episodes"] = len(rows)
    return result


def format_eval(name: str, result: dict) -> str:
    parts = [f"{k} {m:+.3f} ± {s:.3f}" for k, (m, s) in result.items() if isinstance(result[k], tuple)]
    return f"{name}: " + ", ".join(parts)
