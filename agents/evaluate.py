"""Evaluate a policy on the eval prompts: RM score, gold score, KL to π_ref, RLHF objective, diversity.

One evaluator for every algorithm (the PPO agent, SB3, the benchmark's baselines): a policy is
anything with ``act(obs) -> (actions (N,), log-probs (N,))`` and ``reset()``, built for the eval
env by a factory; a model folder gets the cached :class:`textgym.policies.LMPolicy`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch

import textgym  # noqa: F401
from textgym.envs import load_prompts
from textgym.models import EVAL_PROMPTS, load_causal_lm
from textgym.policies import LMPolicy

__all__ = ["distinct_n", "evaluate", "format_eval"]


def distinct_n(responses: list[list[int]], n: int) -> float:
    """Distinct n-grams / all n-grams over a set of token sequences (Li et al., 2016)."""
    grams = [tuple(r[i : i + n]) for r in responses for i in range(len(r) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


@torch.no_grad()
def evaluate(
    model: str | None = None,
    *,
    policy_factory: Callable[[Any], Any] | None = None,
    episodes: int = 128,
    num_envs: int = 64,
    seed: int = 1234,
    temperature: float = 1.0,
    device: str = "cpu",
    **env_kwargs,
) -> dict:
    """Sample ``episodes`` responses on the eval prompts and score them.

    Args:
        model: a causal-LM folder sampled with :class:`LMPolicy` (default: π_ref itself).
        policy_factory: instead of ``model``: ``factory(envs)`` returns the policy to evaluate.
        episodes, num_envs, seed, temperature, device: sampling settings; the eval prompts are
            taken in order (cycled) so every policy answers the same prompts.
        env_kwargs: further ``gym.make`` arguments (``prompts`` defaults to the eval split).

    KL to π_ref per sequence is Σ_t log π(a_t|s_t) − log π_ref(a_t|s_t) over the sampled tokens
    (the k1 estimate, unbiased under π); the objective is score − β·KL with the env's β.

    Returns:
        ``rm_score``, ``score`` (normalised), ``gold_score``, ``kl``, ``objective``,
        ``response_length`` as ``(mean, std)``; ``distinct_1``, ``distinct_2``, ``seconds``,
        ``episodes``; ``samples``: the first episodes' prompt, response and scores.
    """
    env_kwargs.setdefault("prompts", str(EVAL_PROMPTS))
    envs = gym.make_vec("TextRLHF-v0", num_envs=num_envs, vectorization_mode="vector_entry_point",
                        device=device, **env_kwargs)  # fmt: skip
    base = envs.unwrapped
    cols = base.max_prompt_tokens  # response token k sits at column cols + k
    if policy_factory is not None:
        policy = policy_factory(envs)
    else:
        policy_model = base.model if model is None else load_causal_lm(model, device=device, name="model")
        generator = torch.Generator(device=policy_model.device).manual_seed(seed)
        policy = LMPolicy.for_env(policy_model, envs, temperature=temperature, generator=generator)
    prompts = load_prompts(env_kwargs["prompts"])
    start = time.perf_counter()
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
            obs, _, term, trunc, info = envs.step(np.asarray(a.cpu() if torch.is_tensor(a) else a))
            live = ~done
            kl[live] += np.asarray(lp.cpu() if torch.is_tensor(lp) else lp)[live] - info["ref_logprob"][live]
            for i in np.flatnonzero((term | trunc) & live):
                final[i] = {k: info[k][i] for k in ("rm_score", "score_reward", "gold_score", "prompt",
                                                     "response", "response_length")}  # fmt: skip
                final[i]["ids"] = obs["input_ids"][i, cols : cols + final[i]["response_length"]].tolist()
                final[i]["kl"] = float(kl[i])
            done |= term | trunc
        rows.extend(final)
    seconds = time.perf_counter() - start
    rows = rows[:episodes]
    beta = base.kl_coef
    envs.close()
    for r in rows:
        r["objective"] = r["score_reward"] - beta * r["kl"]

    def stat(key: str) -> tuple[float, float]:
        values = np.array([r[key] for r in rows], dtype=np.float64)
        return float(values.mean()), float(values.std())

    names = {"rm_score": "rm_score", "score": "score_reward", "gold_score": "gold_score", "kl": "kl",
             "objective": "objective", "response_length": "response_length"}  # fmt: skip
    result: dict[str, Any] = {key: stat(src) for key, src in names.items()}
    result["distinct_1"] = distinct_n([r["ids"] for r in rows], 1)
    result["distinct_2"] = distinct_n([r["ids"] for r in rows], 2)
    result["seconds"] = seconds
    result["episodes"] = len(rows)
    result["samples"] = [
        {"prompt": r["prompt"], "response": r["response"], "score": float(r["score_reward"]),
         "gold": float(r["gold_score"]), "kl": float(r["kl"])}
        for r in rows[:8]
    ]  # fmt: skip
    return result


def format_eval(name: str, result: dict) -> str:
    parts = [f"{k} {v[0]:+.3f} ± {v[1]:.3f}" for k, v in result.items() if isinstance(v, tuple)]
    parts += [f"distinct-2 {result['distinct_2']:.3f}"]
    return f"{name}: " + ", ".join(parts)
