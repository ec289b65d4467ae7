"""Compare RL algorithms on a task on equal terms: the same KL-regularised objective, the same env,
the same budget of env steps (tokens), the same evaluator, and the same frontier measure.

Tasks (``TASKS``): ``sentiment`` (TextRLHF-v0: learned RM as the proxy, VADER as gold),
``arithmetic`` (TextArithmetic-v0: the exact-answer verifier is reward and gold),
``arithmetic-proxy`` (the same env paying a learned proxy of the verifier; gold stays the verifier),
``smollm2-sentiment`` (SmolLM2 writing reviews), ``smollm2-guess`` (TextMultiTurn-v0: SmolLM2 playing
TextArena's GuessTheNumber; the game's reward is score and gold) and ``smollm2-calculator`` (SmolLM2 with the
calculator tool on ``a * b + c``; the final answer's exact-answer verdict is score and gold).

Beside the final eval scores, each run is summarised by its reward–KL frontier (Gao et al.
2022; :mod:`textgym.agents.frontier`): the training episodes' proxy and gold reward against
d = √KL(π‖π_ref), fitted by R(d) = d(α − β log d), and ``gold_auc``, the gold frontier's mean gain
over KL ∈ [0, ``frontier_kl``] nats — which asks how much gold an algorithm buys for its
divergence, not only where it stopped.

Every built-in pays the same fixed β on KL(π‖π_ref), by the same route: the env pays
β·log π_ref(a_t|s_t) per token and each agent adds −β·log π(a_t|s_t) of its own sample (the k1
per-token reward, whose expected gradient is exactly −β·∇KL): ``torchrl_ppo``, ``grpo``, ``rloo``
and ``reinforce`` in their per-token rewards, the SB3 algorithms through
:class:`textgym.agents.sb3.KLPenaltyCallback` (ent_coef = 0; an entropy bonus is not equivalent).
All but ``grpo`` optimise E[score] − β·KL; ``grpo`` runs its default ``grpo_scale="std"``, which
divides each group's centred score by the group's std (the KL part stays at β), so it follows no
closed-form objective (``grpo_scale="none"`` would).

Budget: an algorithm is charged one env step per generated token of its training episodes, and
never takes more than ``budget``: episode-batch learners shrink their last batch to the episodes
that fit at the length cap, SB3 learns whole rollouts of ``n_steps × n_envs`` that fit.

An algorithm is a small registered adapter: ``train(ctx) -> policy factory``. It trains within
``ctx.budget`` env steps (``ctx.episodes_that_fit(steps)``), reports its learning curve with
``ctx.log(env_steps, score, gold_score, kl)`` (its training episodes' means; gold and KL feed the
frontier), may add env arguments it trains with to ``ctx.env_kwargs`` (the evaluation uses the
same ones), and returns ``factory(envs)`` building a policy with
``act(obs) -> (actions, log-probs)`` and ``reset()`` for the eval env. Add your own::

    from textgym.agents.benchmark import register_algorithm

    @register_algorithm("my_algo")
    def my_algo(ctx):
        ...                        # train with gym.make(ctx.env_id, **ctx.env_kwargs)
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

import numpy as np
import torch

from textgym.envs import DEFAULT_KL_COEF
from textgym.envs.settings import ENV_FIELDS
from textgym.policies import LMSampler
from textgym.threads import use_threads

from .benchmark_report import confidence_interval, frontier_window, write_frontier_table, write_outputs
from .evaluate import evaluate
from .frontier import run_frontier

__all__ = [
    "ALGORITHMS",
    "TASKS",
    "BenchConfig",
    "RunContext",
    "confidence_interval",
    "refit",
    "register_algorithm",
    "run_benchmark",
    "write_frontier_table",
]

ALGORITHMS: dict[str, Callable[[RunContext], Callable[[Any], Any]]] = {}


def register_algorithm(name: str):
    """Register ``fn(ctx) -> policy factory`` under ``name`` (decorator)."""

    def deco(fn):
        ALGORITHMS[name] = fn
        return fn

    return deco


@dataclass(frozen=True)
class Task:
    """A task the benchmark runs on: a registered env and the settings every algorithm shares there.

    ``normalize``: standardise the RM score under π_ref at these settings (a learned RM's scale is
    arbitrary); a verifier's 0/1 is left as it is. ``frontier_kl``: the KL budget (nats per
    sequence) the frontier's area is taken up to, about what the trained algorithms reach.
    ``env``: further ``gym.make`` arguments (a real model, its prompts and chat template);
    ``eval_prompts``: the prompt set the common evaluation samples (None: the training prompts);
    ``agent``: further :class:`PPOConfig` fields of our agents; ``temperature``: the task's sampling temperature,
    of π_ref's calibration and row, of every learner's rollouts and of the common evaluation (a task is defined
    at one temperature: the calculator's π_ref calls its tool at 0.7, rarely at 1). ``num_envs``, ``seeds`` and
    ``calibration_episodes`` are the defaults a :class:`BenchConfig` takes, sized for 2 CPU cores.
    """

    env_id: str
    max_new_tokens: int
    max_prompt_tokens: int | None  # None: the longest prompt's tokens
    kl_coef: float
    normalize: bool
    frontier_kl: float
    budget: int
    agent_lr: float = 3e-4  # our TorchRL agents' policy step size (torchrl_ppo, grpo, rloo)
    agent_epochs: int = 4
    reward_model: str | None = None  # None: the env's own
    env: dict[str, Any] = field(default_factory=dict)
    eval_prompts: str | None = None
    agent: dict[str, Any] = field(default_factory=dict)
    temperature: float = 1.0
    num_envs: int = 32
    seeds: tuple[int, ...] = (0, 1, 2)
    calibration_episodes: int = 512


TASKS = {
    "sentiment": Task("TextRLHF-v0", max_new_tokens=16, max_prompt_tokens=16, kl_coef=DEFAULT_KL_COEF,
                      normalize=True, frontier_kl=8.0, budget=8192),
    "arithmetic": Task("TextArithmetic-v0", max_new_tokens=4, max_prompt_tokens=8, kl_coef=0.05,
                       normalize=False, frontier_kl=0.5, budget=65536, agent_lr=1e-4, agent_epochs=2),
    # the same, trained on the learned proxy of the verifier (gold stays the verifier): over-optimisation
    "arithmetic-proxy": Task("TextArithmetic-v0", max_new_tokens=4, max_prompt_tokens=8, kl_coef=0.05,
                             normalize=True, frontier_kl=4.0, budget=65536, agent_lr=1e-4, agent_epochs=2,
                             reward_model="arithmetic-proxy"),
    # SmolLM2-135M-Instruct asked for reviews (smollm2-sentiment's env), the embedded RM on the response,
    # VADER gold, judged on held-out requests; 21 iterations of 16 episodes per algorithm, 2 seeds
    "smollm2-sentiment": Task("TextRLHF-v0", max_new_tokens=24, max_prompt_tokens=None, kl_coef=0.05,
                              normalize=True, frontier_kl=8.0, budget=8192, agent_lr=1e-5, agent_epochs=2,
                              reward_model="default-response",
                              env={"model": "smollm2-135m-instruct", "chat_template": True,
                                   "prompts": "review-requests"},
                              eval_prompts="review-requests-eval",
                              agent={"critic_learning_rate": 1e-5, "num_minibatches": 4, "warmup_iterations": 2,
                                     "early_stop_kl": 0.05},
                              num_envs=16, seeds=(0, 1), calibration_episodes=256),
    # a conversation: SmolLM2 plays TextArena's GuessTheNumber over 1..10 in 4 guesses (the smollm2-guess-* presets'
    # env); the score and gold are the game's reward, judged on held-out game seeds (docs/multi-turn.md)
    "smollm2-guess": Task("TextMultiTurn-v0", max_new_tokens=256, max_prompt_tokens=None, kl_coef=0.05,
                          normalize=False, frontier_kl=4.0, budget=8192, agent_lr=2e-5, agent_epochs=2,
                          env={"model": "smollm2-135m-instruct", "chat_template": True,
                               "partner": "guess-the-number-10", "max_turn_tokens": 8, "max_turns": 8},
                          agent={"critic_learning_rate": 5e-5, "num_minibatches": 4, "early_stop_kl": 0.05},
                          num_envs=32, seeds=(0, 1), calibration_episodes=128),
    # a tool: SmolLM2 with the calculator on a * b + c (the smollm2-calculator-grpo preset's env at its temperature);
    # score and gold are the exact-answer verdict of the final turn, judged on held-out problems (docs/multi-turn.md)
    "smollm2-calculator": Task("TextMultiTurn-v0", max_new_tokens=144, max_prompt_tokens=None, kl_coef=0.05,
                               normalize=False, frontier_kl=4.0, budget=16384, agent_lr=2e-5, agent_epochs=2,
                               reward_model="calculator-answer",
                               env={"model": "smollm2-135m-instruct", "chat_template": True, "partner": "calculator",
                                    "prompts": "calculator-problems", "gold_scorer": "calculator-answer",
                                    "max_turn_tokens": 32, "max_turns": 3},
                               eval_prompts="calculator-problems-eval", temperature=0.7,
                               agent={"num_minibatches": 4, "early_stop_kl": 0.05},
                               num_envs=32, seeds=(0, 1), calibration_episodes=128),
}  # fmt: skip


@dataclass
class RunContext:
    """What an adapter gets: the env configuration, its budget and seed, and a curve logger."""

    env_kwargs: dict[str, Any]
    budget: int
    seed: int
    num_envs: int
    out: Path
    task: Task = TASKS["sentiment"]
    curve: list[dict[str, float]] = field(default_factory=list)
    env_steps: int = 0

    @property
    def env_id(self) -> str:
        """The registered env of the task (train with ``gym.make(ctx.env_id, **ctx.env_kwargs)``)."""
        return self.task.env_id

    def log(self, env_steps: int, score: float, gold_score: float = math.nan, kl: float = math.nan) -> None:
        """Record training episodes' means after ``env_steps``: the RM score (as the env pays it), the
        gold score and KL(π‖π_ref) per sequence of the policy that sampled them (for the frontier)."""
        self.env_steps = int(env_steps)
        self.curve.append({"env_steps": int(env_steps), "score": float(score), "gold_score": float(gold_score),
                           "kl": float(kl)})  # fmt: skip

    def episodes_that_fit(self, env_steps: int) -> int:
        """Episodes (at most ``num_envs``) that fit in the budget left even if all reach the length cap."""
        return min(self.num_envs, (self.budget - env_steps) // self.policy_tokens_cap)

    @property
    def policy_tokens_cap(self) -> int:
        """The most env steps (policy tokens) one episode can take: the length cap, or in a conversation with
        turn caps ``max_turns × max_turn_tokens`` when fewer (the partner's tokens are not steps)."""
        kw, cap = self.env_kwargs, self.env_kwargs["max_new_tokens"]
        if kw.get("max_turns") is not None and kw.get("max_turn_tokens") is not None:
            cap = min(cap, kw["max_turns"] * kw["max_turn_tokens"])
        return cap


# ---------------------------------------------------------------- baselines without training
class _UniformPolicy:
    def __init__(self, envs, seed: int):
        self.n, self.vocab = envs.num_envs, envs.single_action_space.n
        self.rng = np.random.default_rng(seed)

    def reset(self) -> None:
        pass

    def act(self, obs):
        return self.rng.integers(0, self.vocab, self.n), np.full(self.n, -np.log(self.vocab))


def _sampler_factory(model: torch.nn.Module | None, seed: int, temperature: float = 1.0):
    """Cached sampling of ``model`` (None: the eval env's π_ref) at the task's ``temperature``."""

    def factory(envs):
        m = model if model is not None else envs.unwrapped.model
        generator = torch.Generator(device=m.device).manual_seed(seed)
        return LMSampler.for_env(m, envs, temperature=temperature, generator=generator)

    return factory


@register_algorithm("reference")
def reference(ctx: RunContext):
    return _sampler_factory(None, ctx.seed, ctx.task.temperature)


@register_algorithm("random")
def uniform_random(ctx: RunContext):
    return lambda envs: _UniformPolicy(envs, ctx.seed)


# ---------------------------------------------------------------- episode-batch learners: PPO, GRPO, RLOO, REINFORCE
def _train_in_batches(ctx: RunContext, learner, multiple: int = 1) -> None:
    """Step ``learner.iteration(k)`` while episodes (k a multiple of ``multiple``) fit in the budget."""
    while (k := ctx.episodes_that_fit(ctx.env_steps) // multiple * multiple) > 0:
        row = learner.iteration(k)
        ctx.log(row["env_steps"], row["score"], row["gold_score"], row["kl"])  # cumulative tokens
    learner.envs.close()


GROUP_SIZE = 4  # GRPO/RLOO: episodes per prompt in the benchmark


def agent_config(ctx: RunContext, algo: str):
    """The PPOConfig our TorchRL agent trains with in the bench's env: the bench's defaults, then the task's
    own tuning (a real model's preset), which wins; pure, so a test can read it without loading a model."""
    from .ppo import PPOConfig

    kw = ctx.env_kwargs
    settings = dict(num_minibatches=2 if ctx.num_envs % 2 == 0 else 1, learning_rate=ctx.task.agent_lr,
                    ppo_epochs=ctx.task.agent_epochs, critic_learning_rate=1e-3, temperature=ctx.task.temperature,
                    **{k: v for k, v in ctx.task.env.items() if k in ENV_FIELDS})  # fmt: skip
    settings.update(ctx.task.agent)
    return PPOConfig(total_episodes=10**9, num_envs=ctx.num_envs, seed=ctx.seed, out=str(ctx.out), device="cpu",
                     env_id=ctx.env_id, algo=algo, group_size=GROUP_SIZE, max_new_tokens=kw["max_new_tokens"],
                     kl_coef=kw["kl_coef"], target_kl=None, progress=False, **settings)  # fmt: skip


def _agent(ctx: RunContext, algo: str):
    """Our TorchRL agent with ``algo`` (PPO, or critic-free GRPO/RLOO) in the bench's env, on CPU like the others."""
    from .ppo import Trainer

    trainer = Trainer.create(agent_config(ctx, algo), env_overrides=ctx.env_kwargs)  # the env every algorithm trains in
    _train_in_batches(ctx, trainer, GROUP_SIZE if algo != "ppo" else 1)
    return _sampler_factory(trainer.policy, ctx.seed, ctx.task.temperature)


for _algo, _name in (("ppo", "torchrl_ppo"), ("grpo", "grpo"), ("rloo", "rloo")):
    register_algorithm(_name)(lambda ctx, _a=_algo: _agent(ctx, _a))


@register_algorithm("reinforce")
def reinforce(ctx: RunContext):
    from .reinforce import Reinforce

    learner = Reinforce.create(ctx.env_kwargs, ctx.num_envs, ctx.seed, env_id=ctx.env_id)
    _train_in_batches(ctx, learner)
    return _sampler_factory(learner.policy, ctx.seed, ctx.task.temperature)


# ---------------------------------------------------------------- Stable-Baselines3 (agents/sb3/bench.py)
def _sb3(ctx: RunContext, algo: str):
    from .sb3.bench import train_sb3  # SB3 is imported only when an SB3 algorithm runs

    return train_sb3(ctx, algo)


for _name in ("sb3_ppo", "sb3_a2c", "maskable_ppo"):
    register_algorithm(_name)(lambda ctx, _algo=_name: _sb3(ctx, _algo))


# ---------------------------------------------------------------- the harness
# the algorithms whose rollouts and evaluation sample at a task's temperature (Reinforce and SB3 sample at 1)
SAMPLES_AT_TASK_TEMPERATURE = ("reference", "random", "torchrl_ppo", "grpo", "rloo")


@dataclass
class BenchConfig:
    """One benchmark: algorithms × seeds at a fixed budget of env steps, on one task.

    Attributes:
        task: a name in ``TASKS`` (``sentiment``: TextRLHF-v0, learned RM, VADER gold;
            ``arithmetic``: TextArithmetic-v0, the exact-answer verifier as reward and gold;
            ``arithmetic-proxy``: the same, paying the learned ``arithmetic-proxy`` RM).
        algos: registered algorithm names.
        seeds: seeds per algorithm (default: the task's).
        budget: env steps (tokens) each trained algorithm may take (default: the task's).
        num_envs: parallel episodes for the algorithms that batch them (default: the task's).
        max_new_tokens, max_prompt_tokens, kl_coef, frontier_kl: the env configuration shared by
            all (a fixed prompt block, so train and eval prompts give the same observation shape)
            and the frontier's KL budget; None takes the task's.
        eval_episodes: episodes of the common evaluation.
        calibration_episodes: π_ref episodes that measure its score and gold (the frontier's origin)
            and standardise a learned RM (default: the task's).
        out: output folder.
        threads: torch's CPU threads for every algorithm (None: OMP_NUM_THREADS, else one per core), recorded
            in ``env.json``: the same thread count gives the same tables, however busy the machine.
    """

    task: str = "sentiment"
    algos: list[str] = field(default_factory=lambda: list(ALGORITHMS))
    seeds: list[int] | None = None
    budget: int | None = None  # sentiment's 8192 is sized for ~25 min on 2 CPU cores with 3 seeds
    num_envs: int | None = None
    max_new_tokens: int | None = None
    max_prompt_tokens: int | None = None
    kl_coef: float | None = None
    frontier_kl: float | None = None
    eval_episodes: int = 128
    calibration_episodes: int | None = None
    out: str = "runs/bench"
    threads: int | None = None
    task_budget: int = field(init=False)  # the task's own budget: a run below it is a smoke run, not results

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r} is not a benchmark task; tasks: {sorted(TASKS)}")
        task = TASKS[self.task]
        self.task_budget = task.budget
        for name in ("budget", "max_new_tokens", "max_prompt_tokens", "kl_coef", "frontier_kl", "num_envs", "seeds",
                     "calibration_episodes"):  # fmt: skip
            if getattr(self, name) is None:
                setattr(self, name, list(task.seeds) if name == "seeds" else getattr(task, name))
        unknown = [a for a in self.algos if a not in ALGORITHMS]
        if unknown:
            raise ValueError(f"algos={unknown} are not registered; registered: {sorted(ALGORITHMS)}")
        fixed = [a for a in self.algos if a not in SAMPLES_AT_TASK_TEMPERATURE]
        if task.temperature != 1.0 and fixed:
            raise ValueError(f"algos={fixed} sample at temperature 1, but task={self.task!r} is defined at temperature "
                             f"{task.temperature}; algorithms that sample at a task's temperature: "
                             f"{sorted(SAMPLES_AT_TASK_TEMPERATURE)}")  # fmt: skip
        if min(self.budget, self.num_envs, self.eval_episodes, self.calibration_episodes) < 1 or not self.seeds:
            raise ValueError("budget, num_envs, eval_episodes and calibration_episodes must be >= 1, seeds non-empty")
        threads = self.threads
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"threads={threads!r} must be an int >= 1 or None (one per core)")
        if not self.frontier_kl > 0:
            raise ValueError(f"frontier_kl={self.frontier_kl} must be > 0 (nats per sequence)")


PRESETS = {
    "default": {},
    "quick": {"algos": None, "seeds": [0], "budget": 64, "num_envs": 8, "max_new_tokens": 4, "eval_episodes": 8,
              "calibration_episodes": 16},
}  # fmt: skip


def _reference(cfg: BenchConfig) -> tuple[dict[str, Any], dict[str, float]]:
    """The env every algorithm trains and is evaluated on, and π_ref's mean score and gold in it.

    A learned RM is standardised under π_ref at *these* settings: its stored mean/std were measured
    at another length cap; calibrating here makes π_ref's score 0 and keeps the score's scale the
    one the objective was meant to have. π_ref's means are the frontier's origin (d = 0).
    """
    from textgym.rewards.calibrate import sample_episodes

    task = TASKS[cfg.task]
    kwargs = {"max_new_tokens": cfg.max_new_tokens, "kl_coef": cfg.kl_coef, **task.env,
              **({"max_prompt_tokens": cfg.max_prompt_tokens} if cfg.max_prompt_tokens is not None else {}),
              **({"reward_model": task.reward_model} if task.reward_model else {})}  # fmt: skip
    rows = sample_episodes(episodes=cfg.calibration_episodes, num_envs=min(64, cfg.calibration_episodes), seed=0,
                           env_id=task.env_id, temperature=task.temperature, **kwargs)  # fmt: skip
    rm = np.array([r["rm_score"] for r in rows])
    gold = float(np.nanmean([r["gold_score"] for r in rows]))
    turns = float(np.mean([r["turn_reward_sum"] for r in rows]))  # a partner's rewards: part of the score (0 without)
    if task.normalize:
        return {**kwargs, "normalize_reward": (float(rm.mean()), float(rm.std()))}, {"score": turns, "gold_score": gold}
    return {**kwargs, "normalize_reward": False}, {"score": float(rm.mean()) + turns, "gold_score": gold}


def run_benchmark(cfg: BenchConfig) -> list[dict]:
    """Train and evaluate every (algorithm, seed); write results.csv/.md, curves and frontier plots."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = use_threads(cfg.threads)  # one thread count for every algorithm: their rounding depends on it
    env_id = TASKS[cfg.task].env_id
    env_kwargs, baseline = _reference(cfg)
    window = frontier_window(cfg.max_new_tokens)
    rows, curves = [], {}
    for algo in cfg.algos:
        for seed in cfg.seeds:
            ctx = RunContext(dict(env_kwargs), cfg.budget, seed, cfg.num_envs, out / f"{algo}_{seed}", TASKS[cfg.task])
            start = time.perf_counter()
            factory = ALGORITHMS[algo](ctx)
            train_s = time.perf_counter() - start
            # evaluated in the env configuration it trained in (ctx.env_kwargs: masks included), on the
            # task's held-out prompts where it has them
            held_out = {"prompts": TASKS[cfg.task].eval_prompts} if TASKS[cfg.task].eval_prompts else {}
            result = evaluate(policy_factory=factory, episodes=cfg.eval_episodes, env_id=env_id,
                              num_envs=min(cfg.num_envs, cfg.eval_episodes), seed=1234,
                              **{**ctx.env_kwargs, **held_out})  # fmt: skip
            frontier = run_frontier(ctx.curve, baseline, cfg.frontier_kl, window)
            row = {"algo": algo, "seed": seed, "env_steps": ctx.env_steps, "train_s": round(train_s, 2),
                   "env_steps_per_s": round(ctx.env_steps / train_s, 1) if ctx.env_steps else 0.0,
                   **{k: round(v[0], 4) for k, v in result.items() if isinstance(v, tuple)},
                   **({"win_rate": round(result["win_rate"], 4)} if "win_rate" in result else {}),  # a game's wins
                   "distinct_1": round(result["distinct_1"], 4), "distinct_2": round(result["distinct_2"], 4),
                   **{k: round(v, 4) for k, v in frontier.items()}}  # fmt: skip
            rows.append(row)
            curves[(algo, seed)] = ctx.curve
            print(json.dumps(row), flush=True)
    (out / "curves.json").write_text(json.dumps({f"{a}/{s}": c for (a, s), c in curves.items()}) + "\n")
    setup = {"task": cfg.task, "env_id": env_id, **env_kwargs, "reference": baseline, "frontier_kl": cfg.frontier_kl,
             "frontier_window": window, "budget": cfg.budget, "eval_episodes": cfg.eval_episodes,
             "threads": threads}  # fmt: skip
    (out / "env.json").write_text(json.dumps(setup) + "\n")
    write_outputs(rows, curves, out, cfg, baseline, env_id)
    return rows


def refit(out: str | Path, frontier_kl: float | None = None) -> list[dict]:
    """Recompute the frontier columns, tables and plots of a finished benchmark from its own files.

    Reads ``results.csv``, ``curves.json`` and ``env.json`` (nothing is trained or evaluated
    again); ``frontier_kl`` moves the AUC's KL limit. For a benchmark run before a change to
    :mod:`textgym.agents.frontier`, or to read its frontier at another KL.
    """
    out = Path(out)
    setup = json.loads((out / "env.json").read_text())
    if frontier_kl is not None:
        setup["frontier_kl"] = frontier_kl
    setup["frontier_window"] = frontier_window(setup["max_new_tokens"])  # this version's pooling
    _rename_gold(setup["reference"])
    (out / "env.json").write_text(json.dumps(setup) + "\n")
    named = json.loads((out / "curves.json").read_text())
    for point in (p for c in named.values() for p in c):
        _rename_gold(point)
    (out / "curves.json").write_text(json.dumps(named) + "\n")
    known = {k: setup[k] for k in ("budget", "eval_episodes", "frontier_kl", "kl_coef", "max_new_tokens") if k in setup}
    with (out / "results.csv").open() as f:
        rows = [{k: v if k == "algo" else float(v) for k, v in r.items()} for r in csv.DictReader(f)]
    cfg = BenchConfig(task=setup["task"], algos=list(dict.fromkeys(r["algo"] for r in rows)),
                      seeds=sorted({int(r["seed"]) for r in rows}), **known)  # fmt: skip
    curves = {(name.split("/")[0], int(name.split("/")[1])): c for name, c in named.items()}
    for row in rows:
        row["seed"] = int(row["seed"])
        fit = run_frontier(curves[(row["algo"], row["seed"])], setup["reference"], cfg.frontier_kl,
                           frontier_window(cfg.max_new_tokens))  # fmt: skip
        row.update({k: round(v, 4) for k, v in fit.items()})
    write_outputs(rows, curves, out, cfg, setup["reference"], TASKS[cfg.task].env_id)
    return rows


def _rename_gold(point: dict) -> None:
    """A benchmark written before the curves said ``gold_score`` (the metrics' name) called it ``gold``."""
    if "gold" in point and "gold_score" not in point:
        point["gold_score"] = point.pop("gold")
