"""Compare RL algorithms on TextRLHF-v0 on equal terms: the same KL-regularised objective, the same env,
the same budget of env steps (tokens), the same evaluator.

Every built-in optimises E[score] − β·KL(π‖π_ref) with the same fixed β, by the same route: the
env pays β·log π_ref(a_t|s_t) per token and each agent adds −β·log π(a_t|s_t) of its own sample
(the k1 per-token reward, whose expected gradient is exactly the objective's): ``torchrl_ppo``,
``grpo``, ``rloo`` and ``reinforce`` in their per-token rewards, the SB3 algorithms through
:class:`textgym.agents.sb3.KLPenaltyCallback` (ent_coef = 0; an entropy bonus is not equivalent).

Budget: an algorithm is charged one env step per generated token of its training episodes, and
never takes more than ``budget``: episode-batch learners shrink their last batch to the episodes
that fit at the length cap, SB3 learns whole rollouts of ``n_steps × n_envs`` that fit.

An algorithm is a small registered adapter: ``train(ctx) -> policy factory``. It trains within
``ctx.budget`` env steps (``ctx.episodes_that_fit(steps)``), reports its learning curve with
``ctx.log(env_steps, score)``, may add env arguments it trains with to ``ctx.env_kwargs`` (the
evaluation uses the same ones), and returns ``factory(envs)`` building a policy with
``act(obs) -> (actions, log-probs)`` and ``reset()`` for the eval env. Add your own::

    from textgym.agents.benchmark import register_algorithm

    @register_algorithm("my_algo")
    def my_algo(ctx):
        ...                        # train with gym.make("TextRLHF-v0", **ctx.env_kwargs)
        return lambda envs: MyPolicy(envs)

Built-ins: ``torchrl_ppo`` (ours), ``grpo`` and ``rloo`` (ours, critic-free, groups of 4 episodes per
prompt), ``sb3_ppo``, ``sb3_a2c``, ``maskable_ppo`` (top-p masks, NLPO), ``reinforce`` (policy
gradient with a learned value baseline), and two that do not train:
``reference`` (π_ref) and ``random`` (uniform tokens).
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

import textgym  # noqa: F401
from textgym.envs import DEFAULT_KL_COEF
from textgym.policies import LMSampler

from .evaluate import evaluate

__all__ = ["ALGORITHMS", "BenchConfig", "RunContext", "confidence_interval", "register_algorithm", "run_benchmark"]

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
    env_steps: int = 0

    def log(self, env_steps: int, score: float) -> None:
        """Record the training episodes' mean RM score (normalised, as the env pays it) after ``env_steps``."""
        self.env_steps = int(env_steps)
        self.curve.append((int(env_steps), float(score)))

    def episodes_that_fit(self, env_steps: int) -> int:
        """Episodes (at most ``num_envs``) that fit in the budget left even if all reach the length cap."""
        return min(self.num_envs, (self.budget - env_steps) // self.env_kwargs["max_new_tokens"])


# ---------------------------------------------------------------- baselines without training
class _UniformPolicy:
    def __init__(self, envs, seed: int):
        self.n, self.vocab = envs.num_envs, envs.single_action_space.n
        self.rng = np.random.default_rng(seed)

    def reset(self) -> None:
        pass

    def act(self, obs):
        return self.rng.integers(0, self.vocab, self.n), np.full(self.n, -np.log(self.vocab))


def _sampler_factory(model: torch.nn.Module | None, seed: int):
    """Cached sampling of ``model`` (None: the eval env's π_ref) at temperature 1."""

    def factory(envs):
        m = model if model is not None else envs.unwrapped.model
        return LMSampler.for_env(m, envs, generator=torch.Generator(device=m.device).manual_seed(seed))

    return factory


@register_algorithm("reference")
def reference(ctx: RunContext):
    return _sampler_factory(None, ctx.seed)


@register_algorithm("random")
def uniform_random(ctx: RunContext):
    return lambda envs: _UniformPolicy(envs, ctx.seed)


# ---------------------------------------------------------------- episode-batch learners: PPO, GRPO, RLOO, REINFORCE
def _train_in_batches(ctx: RunContext, learner, multiple: int = 1) -> None:
    """Step ``learner.iteration(k)`` while episodes (k a multiple of ``multiple``) fit in the budget."""
    while (k := ctx.episodes_that_fit(ctx.env_steps) // multiple * multiple) > 0:
        row = learner.iteration(k)
        ctx.log(row["env_steps"], row["score"])  # cumulative tokens of its training episodes
    learner.envs.close()


GROUP_SIZE = 4  # GRPO/RLOO: episodes per prompt in the benchmark


def _agent(ctx: RunContext, algo: str):
    """Our TorchRL agent with ``algo`` (PPO, or critic-free GRPO/RLOO) in the bench's env, on CPU like the others."""
    from .ppo import PPOConfig, Trainer

    kw = ctx.env_kwargs
    cfg = PPOConfig(total_episodes=10**9, num_envs=ctx.num_envs, seed=ctx.seed, out=str(ctx.out), device="cpu",
                    algo=algo, group_size=GROUP_SIZE, max_new_tokens=kw["max_new_tokens"], kl_coef=kw["kl_coef"],
                    target_kl=None, num_minibatches=2 if ctx.num_envs % 2 == 0 else 1, learning_rate=3e-4,
                    critic_learning_rate=1e-3, progress=False)  # fmt: skip
    trainer = Trainer.create(cfg, env_overrides=kw)  # the very env every algorithm trains in
    _train_in_batches(ctx, trainer, GROUP_SIZE if algo != "ppo" else 1)
    return _sampler_factory(trainer.policy, ctx.seed)


for _algo, _name in (("ppo", "torchrl_ppo"), ("grpo", "grpo"), ("rloo", "rloo")):
    register_algorithm(_name)(lambda ctx, _a=_algo: _agent(ctx, _a))


@register_algorithm("reinforce")
def reinforce(ctx: RunContext):
    from .reinforce import Reinforce

    learner = Reinforce.create(ctx.env_kwargs, ctx.num_envs, ctx.seed)
    _train_in_batches(ctx, learner)
    return _sampler_factory(learner.policy, ctx.seed)


# ---------------------------------------------------------------- Stable-Baselines3
class _SB3Sampler:
    """An SB3 policy acting on the native vector env's batched observations (masked as in training)."""

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
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList
    from stable_baselines3.common.env_util import make_vec_env

    from .sb3 import KLPenaltyCallback, MaskableLMPolicy
    from .sb3 import LMPolicy as SB3LMPolicy

    masked = algo == "maskable_ppo"
    if masked:
        ctx.env_kwargs["action_mask_top_p"] = 0.9  # trained and evaluated with the same masks
    env_kwargs = dict(ctx.env_kwargs)
    n_envs = min(ctx.num_envs, 8)  # SB3 steps sub-envs one by one and re-encodes every observation
    vec = make_vec_env(lambda: gym.make("TextRLHF-v0", **env_kwargs), n_envs=n_envs, seed=ctx.seed)
    common = {"ent_coef": 0.0, "seed": ctx.seed, "gamma": 1.0, "device": "cpu", "verbose": 0,
              "policy_kwargs": {"model_path": env_kwargs.get("model")}}  # fmt: skip
    n_steps = max(2, min(32, ctx.budget // n_envs))
    if algo == "sb3_a2c":
        n_steps = min(n_steps, 8)
        model = A2C(SB3LMPolicy, vec, n_steps=n_steps, learning_rate=1e-5, **common)
    else:
        cls, pol = (MaskablePPO, MaskableLMPolicy) if masked else (PPO, SB3LMPolicy)
        model = cls(pol, vec, n_steps=n_steps, batch_size=min(64, n_steps * n_envs), n_epochs=2,
                    learning_rate=3e-5, **common)  # fmt: skip

    class Curve(BaseCallback):
        def _on_step(self) -> bool:
            scores = [i["score_reward"] for i in self.locals["infos"] if "score_reward" in i]
            if scores:
                ctx.log(self.num_timesteps, float(np.mean(scores)))
            return True

    rollout = n_steps * n_envs  # SB3 learns whole rollouts: take the ones that fit in the budget
    model.learn(total_timesteps=(ctx.budget // rollout) * rollout, callback=CallbackList([KLPenaltyCallback(),
                                                                                         Curve()]))  # fmt: skip
    ctx.env_steps = model.num_timesteps
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
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    budget: int = 8192  # sized for about 30 min on 2 CPU cores with 3 seeds (SB3 runs ~50 env steps/s there)
    num_envs: int = 32
    max_new_tokens: int = 16
    max_prompt_tokens: int = 16
    kl_coef: float = DEFAULT_KL_COEF
    eval_episodes: int = 128
    calibration_episodes: int = 512
    out: str = "runs/bench"

    def __post_init__(self) -> None:
        unknown = [a for a in self.algos if a not in ALGORITHMS]
        if unknown:
            raise ValueError(f"algos={unknown} are not registered; registered: {sorted(ALGORITHMS)}")
        if min(self.budget, self.num_envs, self.eval_episodes, self.calibration_episodes) < 1 or not self.seeds:
            raise ValueError("budget, num_envs, eval_episodes and calibration_episodes must be >= 1, seeds non-empty")


PRESETS = {
    "default": {},
    "quick": {"algos": None, "seeds": [0], "budget": 64, "num_envs": 8, "max_new_tokens": 4, "eval_episodes": 8,
              "calibration_episodes": 16},
}  # fmt: skip


def _env_kwargs(cfg: BenchConfig) -> dict[str, Any]:
    """The env every algorithm trains and is evaluated on, the RM standardised under π_ref at *these* settings.

    The stored mean/std of the embedded RM were measured at another length cap; calibrating here
    makes π_ref's score 0 and keeps the score's scale the one the objective was meant to have.
    """
    from textgym.rewards.calibrate import calibrate

    kwargs = {"max_new_tokens": cfg.max_new_tokens, "max_prompt_tokens": cfg.max_prompt_tokens,
              "kl_coef": cfg.kl_coef}  # fmt: skip
    mean, std = calibrate(episodes=cfg.calibration_episodes, num_envs=min(64, cfg.calibration_episodes), seed=0,
                          **kwargs)  # fmt: skip
    return {**kwargs, "normalize_reward": (mean, std)}


def run_benchmark(cfg: BenchConfig) -> list[dict]:
    """Train and evaluate every (algorithm, seed); write results.csv/.md, curves and frontier plots."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    env_kwargs = _env_kwargs(cfg)
    rows, curves = [], {}
    for algo in cfg.algos:
        for seed in cfg.seeds:
            ctx = RunContext(dict(env_kwargs), cfg.budget, seed, cfg.num_envs, out / f"{algo}_{seed}")
            start = time.perf_counter()
            factory = ALGORITHMS[algo](ctx)
            train_s = time.perf_counter() - start
            # evaluated in the env configuration it trained in (ctx.env_kwargs: masks included)
            result = evaluate(policy_factory=factory, episodes=cfg.eval_episodes,
                              num_envs=min(cfg.num_envs, cfg.eval_episodes), seed=1234, **ctx.env_kwargs)  # fmt: skip
            row = {"algo": algo, "seed": seed, "env_steps": ctx.env_steps, "train_s": round(train_s, 2),
                   "env_steps_per_s": round(ctx.env_steps / train_s, 1) if ctx.env_steps else 0.0,
                   **{k: round(v[0], 4) for k, v in result.items() if isinstance(v, tuple)},
                   "distinct_1": round(result["distinct_1"], 4),
                   "distinct_2": round(result["distinct_2"], 4)}  # fmt: skip
            rows.append(row)
            curves[(algo, seed)] = ctx.curve
            print(json.dumps(row), flush=True)
    _write_tables(rows, out)
    _plot(rows, curves, out)
    (out / "curves.json").write_text(json.dumps({f"{a}/{s}": c for (a, s), c in curves.items()}) + "\n")
    (out / "env.json").write_text(json.dumps(env_kwargs) + "\n")
    return rows


# Two-sided 95 % Student-t quantiles t_{0.975, df}; beyond the table the normal 1.96 is within 2 %.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045,
         2.042]  # fmt: skip


def confidence_interval(values) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (Student t, n − 1 degrees of freedom).

    One value has no interval: its half-width is NaN.
    """
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return float(v.mean()), math.nan
    t = _T975[v.size - 2] if v.size - 1 <= len(_T975) else 1.96
    return float(v.mean()), float(t * v.std(ddof=1) / math.sqrt(v.size))


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
            mean, half = confidence_interval([r[k] for r in group])
            cells.append(f"{mean:.3f}" if math.isnan(half) else f"{mean:.3f} ± {half:.3f}")
        lines.append(f"| {algo} | " + " | ".join(cells) + " |")
    n_seeds = len({r["seed"] for r in rows})
    lines.append(f"\nmean ± half-width of the 95 % confidence interval (Student t) over {n_seeds} seeds")
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
    ax.set_ylabel("RM score (normalised) of training episodes")
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
