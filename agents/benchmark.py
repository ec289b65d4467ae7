"""Compare RL algorithms on TextRLHF-v0 on equal terms: same env, same budget of env steps
(tokens), same evaluator.

An algorithm is a small registered adapter: ``train(ctx) -> policy factory``. It trains within
``ctx.budget`` env steps, reports its learning curve with ``ctx.log(env_steps, rm_score)``, and
returns ``factory(envs)`` building a policy with ``act(obs) -> (actions, log-probs)`` and
``reset()`` for the eval env. Add your own::

    from textgym.agents.benchmark import register_algorithm

    @register_algorithm("my_algo")
    def my_algo(ctx):
        ...                        # train with gym.make("TextRLHF-v0", **ctx.env_kwargs)
        return lambda envs: MyPolicy(envs)

Built-ins: ``torchrl_ppo`` (ours), ``sb3_ppo``, ``sb3_a2c``, ``maskable_ppo`` (top-p masks),
``reinforce`` (policy gradient with a learned value baseline), and two that do not train:
``reference`` (π_ref) and ``random`` (uniform tokens). SB3 algorithms get ``ent_coef = β``: with
the env's reward β·log π_ref, an entropy bonus β optimises E[score] − β·KL(π‖π_ref) in
expectation, the objective our agent optimises with its per-token KL penalty.
"""

from __future__ import annotations

import csv
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

import textgym  # noqa: F401
from textgym.policies import LMPolicy

from .ppo.evaluate import evaluate

__all__ = ["ALGORITHMS", "BenchConfig", "RunContext", "register_algorithm", "run_benchmark"]

ALGORITHMS: dict[str, Callable[[RunContext], Callable[[Any], Any]]] = {}


def register_algorithm(name: str):
    """Register ``fn(ctx) -> policy factory`` under ``name`` (decorator)."""

    def deco(fn):
        ALGORITHMS[name] = fn
        return fn

    return deco


@dataclass
class RunContext:
    """What an adapter gets: the env configuration, its budget and seed, and a curve logger."""

    env_kwargs: dict[str, Any]
    budget: int
    seed: int
    num_envs: int
    out: Path
    curve: list[tuple[int, float]] = field(default_factory=list)

    def log(self, env_steps: int, rm_score: float) -> None:
        self.curve.append((int(env_steps), float(rm_score)))


# ---------------------------------------------------------------- baselines without training
class _UniformPolicy:
    def __init__(self, envs, seed: int):
        self.n, self.vocab = envs.num_envs, envs.single_action_space.n
        self.rng = np.random.default_rng(seed)

    def reset(self) -> None:
        pass

    def act(self, obs):
        return self.rng.integers(0, self.vocab, self.n), np.full(self.n, -np.log(self.vocab))


@register_algorithm("reference")
def reference(ctx: RunContext):
    return lambda envs: LMPolicy.for_env(envs.unwrapped.model, envs, generator=torch.Generator().manual_seed(ctx.seed))


@register_algorithm("random")
def uniform_random(ctx: RunContext):
    return lambda envs: _UniformPolicy(envs, ctx.seed)


# ---------------------------------------------------------------- our TorchRL PPO
def _lm_factory(model: torch.nn.Module, seed: int):
    return lambda envs: LMPolicy.for_env(model, envs, generator=torch.Generator().manual_seed(seed))


@register_algorithm("torchrl_ppo")
def torchrl_ppo(ctx: RunContext):
    from .ppo import PPOConfig, Trainer

    kw = ctx.env_kwargs
    cfg = PPOConfig(total_episodes=10**9, num_envs=ctx.num_envs, seed=ctx.seed, out=str(ctx.out),
                    max_new_tokens=kw["max_new_tokens"], kl_coef=kw["kl_coef"], target_kl=None,
                    num_minibatches=2 if ctx.num_envs % 2 == 0 else 1, learning_rate=3e-4,
                    critic_learning_rate=1e-3, progress=False,
                    **{k: kw[k] for k in ("model", "reward_model", "prompts") if k in kw})  # fmt: skip
    trainer = Trainer.create(cfg)
    steps = 0
    while steps < ctx.budget:
        row = trainer.iteration()
        steps += int(round(row["response_length"] * ctx.num_envs))
        ctx.log(steps, row["rm_score"])
    trainer.envs.close()
    return _lm_factory(trainer.policy, ctx.seed)


# ---------------------------------------------------------------- REINFORCE with a learned baseline
@register_algorithm("reinforce")
def reinforce(ctx: RunContext):
    """∇J ≈ Σ_t ∇log π(a_t|s_t)·(G_t − V(s_t)), G_t the KL-penalised return-to-go (γ = 1)."""
    from .ppo.models import LMHead, ValueHead, make_actor, make_critic
    from .ppo.rollout import collect, per_token_rewards

    envs = gym.make_vec("TextRLHF-v0", num_envs=ctx.num_envs, vectorization_mode="vector_entry_point",
                        autoreset_mode="next_step", **ctx.env_kwargs)  # fmt: skip
    base = envs.unwrapped
    torch.manual_seed(ctx.seed)
    policy = make_actor(base.model)
    critic = make_critic(base.reward_model, policy)
    actor_head, value_head = LMHead(policy, base.max_prompt_tokens), ValueHead(critic, base.max_prompt_tokens)
    optim = torch.optim.AdamW([{"params": policy.parameters(), "lr": 1e-4},
                               {"params": critic.parameters(), "lr": 1e-3}])  # fmt: skip
    sampler = LMPolicy.for_env(policy, envs, generator=torch.Generator().manual_seed(ctx.seed))
    steps, first = 0, True
    beta = base.kl_coef
    while steps < ctx.budget:
        sampler.reset()
        batch = collect(envs, sampler, seed=ctx.seed if first else None)
        first = False
        d = batch.data
        mask = d["mask"]
        reward, _ = per_token_rewards(d["env_reward"], d["sample_log_prob"], d["ref_logprob"], mask, beta, beta)
        returns = reward.flip(1).cumsum(1).flip(1)  # (B, T) return-to-go
        logits = actor_head(d["sequence"], d["sequence_mask"])  # ONE forward per sequence
        logp = torch.log_softmax(logits, -1).gather(-1, d["action"].unsqueeze(-1)).squeeze(-1)
        values = value_head(d["sequence"], d["sequence_mask"])[..., 0]
        advantage = (returns - values).detach()
        m = mask.float()
        loss = -(logp * advantage * m).sum() / m.sum() + 0.5 * (((values - returns) ** 2) * m).sum() / m.sum()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(policy.parameters()) + list(critic.parameters()), 1.0)
        optim.step()
        steps += int(mask.sum())
        ctx.log(steps, float(batch.rm_score.mean()))
    envs.close()
    return _lm_factory(policy, ctx.seed)


# ---------------------------------------------------------------- Stable-Baselines3
class _SB3Sampler:
    """An SB3 policy acting on the native vector env's batched observations."""

    def __init__(self, model, masked: bool, envs):
        self.model, self.masked, self.envs = model, masked, envs

    def reset(self) -> None:
        pass

    @torch.no_grad()
    def act(self, obs):
        policy = self.model.policy
        obs_t, _ = policy.obs_to_tensor(obs)
        dist = policy.get_distribution(obs_t)
        if self.masked:
            dist.apply_masking(torch.as_tensor(self.envs.unwrapped.action_masks()))
        actions = dist.get_actions()
        return actions, dist.log_prob(actions)


def _sb3(ctx: RunContext, algo: str):
    from sb3_contrib import MaskablePPO
    from stable_baselines3 import A2C, PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    from .sb3 import LMPolicy as SB3LMPolicy
    from .sb3 import MaskableLMPolicy

    masked = algo == "maskable_ppo"
    env_kwargs = {**ctx.env_kwargs, **({"action_mask_top_p": 0.9} if masked else {})}
    n_envs = min(ctx.num_envs, 8)  # SB3 steps sub-envs one by one and re-encodes every observation
    vec = make_vec_env(lambda: gym.make("TextRLHF-v0", **env_kwargs), n_envs=n_envs, seed=ctx.seed)
    beta = ctx.env_kwargs["kl_coef"]
    common = {"ent_coef": beta, "seed": ctx.seed, "gamma": 1.0, "device": "cpu", "verbose": 0}
    model_path = ctx.env_kwargs.get("model")
    policy_kwargs = {"model_path": model_path}
    n_steps = max(2, min(32, ctx.budget // n_envs))
    if algo == "sb3_a2c":
        model = A2C(SB3LMPolicy, vec, n_steps=min(n_steps, 8), learning_rate=1e-5, policy_kwargs=policy_kwargs,
                    **common)  # fmt: skip
    else:
        cls, pol = (MaskablePPO, MaskableLMPolicy) if masked else (PPO, SB3LMPolicy)
        model = cls(pol, vec, n_steps=n_steps, batch_size=min(64, n_steps * n_envs), n_epochs=2,
                    learning_rate=3e-5, policy_kwargs=policy_kwargs, **common)  # fmt: skip

    class Curve(BaseCallback):
        def _on_step(self) -> bool:
            scores = [i["rm_score"] for i in self.locals["infos"] if "rm_score" in i]
            if scores:
                ctx.log(self.num_timesteps, float(np.mean(scores)))
            return True

    model.learn(total_timesteps=ctx.budget, callback=Curve())
    vec.close()
    return lambda envs: _SB3Sampler(model, masked, envs)


for _name in ("sb3_ppo", "sb3_a2c", "maskable_ppo"):
    register_algorithm(_name)(lambda ctx, _algo=_name: _sb3(ctx, _algo))


# ---------------------------------------------------------------- the harness
@dataclass
class BenchConfig:
    """One benchmark: algorithms × seeds at a fixed budget of env steps.

    Attributes:
        algos: registered algorithm names.
        seeds: seeds per algorithm.
        budget: env steps (tokens) each trained algorithm may take.
        num_envs: parallel episodes for the algorithms that batch them.
        max_new_tokens, max_prompt_tokens, kl_coef: the env configuration shared by all (a fixed
            prompt block, so train and eval prompts give the same observation shape).
        eval_episodes: episodes of the common evaluation.
        out: output folder.
    """

    algos: list[str] = field(default_factory=lambda: list(ALGORITHMS))
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    budget: int = 8192  # sized for under 30 min on 2 CPU cores (SB3 runs ~50 env steps/s there)
    num_envs: int = 32
    max_new_tokens: int = 16
    max_prompt_tokens: int = 16
    kl_coef: float = 0.05
    eval_episodes: int = 128
    out: str = "runs/bench"

    def __post_init__(self) -> None:
        unknown = [a for a in self.algos if a not in ALGORITHMS]
        if unknown:
            raise ValueError(f"algos={unknown} are not registered; registered: {sorted(ALGORITHMS)}")
        if self.budget < 1 or self.num_envs < 1 or self.eval_episodes < 1 or not self.seeds:
            raise ValueError("budget, num_envs and eval_episodes must be >= 1 and seeds non-empty")


PRESETS = {
    "default": {},
    "quick": {"algos": None, "seeds": [0], "budget": 64, "num_envs": 8, "max_new_tokens": 4, "eval_episodes": 8},
}


def run_benchmark(cfg: BenchConfig) -> list[dict]:
    """Train and evaluate every (algorithm, seed); write results.csv/.md, curves and frontier plots."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    env_kwargs = {"max_new_tokens": cfg.max_new_tokens, "max_prompt_tokens": cfg.max_prompt_tokens,
                  "kl_coef": cfg.kl_coef}  # fmt: skip
    rows, curves = [], {}
    for algo in cfg.algos:
        for seed in cfg.seeds:
            ctx = RunContext(env_kwargs, cfg.budget, seed, cfg.num_envs, out / f"{algo}_{seed}")
            start = time.perf_counter()
            factory = ALGORITHMS[algo](ctx)
            train_s = time.perf_counter() - start
            result = evaluate(policy_factory=factory, episodes=cfg.eval_episodes,
                              num_envs=min(cfg.num_envs, cfg.eval_episodes), seed=1234, **env_kwargs)  # fmt: skip
            trained_steps = ctx.curve[-1][0] if ctx.curve else 0
            row = {"algo": algo, "seed": seed, "env_steps": trained_steps, "train_s": round(train_s, 2),
                   "env_steps_per_s": round(trained_steps / train_s, 1) if trained_steps else 0.0,
                   **{k: round(v[0], 4) for k, v in result.items() if isinstance(v, tuple)},
                   "distinct_1": round(result["distinct_1"], 4),
                   "distinct_2": round(result["distinct_2"], 4)}  # fmt: skip
            rows.append(row)
            curves[(algo, seed)] = ctx.curve
            print(json.dumps(row), flush=True)
    _write_tables(rows, out)
    _plot(rows, curves, out)
    (out / "curves.json").write_text(json.dumps({f"{a}/{s}": c for (a, s), c in curves.items()}) + "\n")
    return rows


def _write_tables(rows: list[dict], out: Path) -> None:
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    keys = ["score", "gold_score", "kl", "objective", "distinct_2", "response_length", "env_steps", "train_s",
            "env_steps_per_s"]  # fmt: skip
    lines = ["| algorithm | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for algo in dict.fromkeys(r["algo"] for r in rows):
        group = [r for r in rows if r["algo"] == algo]
        cells = []
        for k in keys:
            v = np.array([r[k] for r in group], dtype=float)
            cells.append(f"{v.mean():.3f} ± {v.std():.3f}" if len(v) > 1 else f"{v.mean():.3f}")
        lines.append(f"| {algo} | " + " | ".join(cells) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


def _plot(rows: list[dict], curves: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for algo in dict.fromkeys(a for a, _ in curves):
        runs = [c for (a, _), c in curves.items() if a == algo and c]
        if not runs:
            continue
        grid = np.linspace(0, max(c[-1][0] for c in runs), 30)
        ys = np.array([np.interp(grid, [s for s, _ in c], [v for _, v in c]) for c in runs])
        ax.plot(grid, ys.mean(0), label=algo)
        ax.fill_between(grid, ys.mean(0) - ys.std(0), ys.mean(0) + ys.std(0), alpha=0.2)
    ax.set_xlabel("env steps (tokens)")
    ax.set_ylabel("RM score (raw) of training episodes")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "rm_vs_steps.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "score", "RM score (normalised)"), (axes[1], "gold_score", "gold score")):
        for algo in dict.fromkeys(r["algo"] for r in rows):
            group = [r for r in rows if r["algo"] == algo]
            ax.scatter([r["kl"] for r in group], [r[key] for r in group], label=algo)
        ax.set_xlabel("KL(π ‖ π_ref) per sequence (nats)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("reward–KL frontier (eval prompts)")
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=110)
    plt.close(fig)
