"""The one typed config of the PPO agent; every field is a ``textgym train`` flag."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields
from typing import Any

from textgym.envs import DEFAULT_KL_COEF, check_kl_coef

__all__ = ["KL_PENALTIES", "PPOConfig", "PRESETS", "RESUME_APPLIED", "RESUME_FREE", "add_config_args",
           "config_from_args"]  # fmt: skip

KL_PENALTIES = ("k1_reward", "k2_loss", "k3_loss")
ALGOS = ("ppo", "grpo", "rloo")
# On resume: fields that may change and are applied from the resumed iteration on (the optimizer's
# learning rates are set again after its state loads), and fields that do not touch the run's numbers.
# Every other field defines the run (models, env, seed, algorithm): a change is refused.
RESUME_APPLIED = ("total_episodes", "learning_rate", "critic_learning_rate")
RESUME_FREE = ("out", "resume", "checkpoint_every", "progress")


@dataclass
class PPOConfig:
    """PPO for RLHF on TextRLHF-v0; defaults after TRL and "The N+ Implementation Details of
    RLHF with PPO" (Huang et al., 2024).

    Attributes:
        total_episodes: episodes (prompt + response) to train on.
        num_envs: env slots = episodes per rollout (the PPO batch).
        algo: ``ppo`` (clipped surrogate, GAE over a learned critic), ``grpo`` (no critic: each
            episode's return minus its group's mean, over the group's std, for every token;
            Shao et al., 2024) or ``rloo`` (no critic: the return minus the mean of the other
            G − 1 returns of its group, an unbiased baseline; Ahmadian et al., 2024).
        group_size: G, episodes per prompt for ``grpo``/``rloo`` (``num_envs`` holds
            ``num_envs / G`` groups).
        seed: seeds the env, the sampling and the model initialisation.
        device: ``auto``, ``cpu`` or ``cuda`` (bf16 autocast on CUDA).
        out: output folder (metrics, TensorBoard events, checkpoints, HF folders).
        resume: continue the run in ``out`` from its checkpoint; changing a field that defines the run is refused.
            ``RESUME_APPLIED`` fields may change (applied from the resumed iteration on), ``RESUME_FREE``
            ones freely; a folder without a run starts one.
        model: π_ref and the policy's initialisation (HF folder or id; default embedded LM).
        reward_model: r_φ (any route ``gym.make(..., reward_model=)`` accepts; default embedded RM).
        prompts: train prompts (list file or default set).
        max_new_tokens: response length cap of the env.
        missing_eos_penalty: env penalty for responses that reach the length cap without a stop token.
        kl_coef: initial β (the env's default, ``textgym.envs.DEFAULT_KL_COEF``).
        target_kl: per-sequence KL target of the adaptive controller; None keeps β fixed.
        kl_horizon: horizon (in episodes) of the adaptive controller (Ziegler et al., 2019).
        kl_penalty: how β·KL(π‖π_ref) enters: ``k1_reward`` (default: −β·log(π_old/π_ref) in each
            token's reward; its expected gradient is exactly that of the KL-regularised
            objective), ``k2_loss`` (β·mean ½·log²(π/π_ref) in the loss, with its gradient: the
            gradient of the per-token forward KL(π‖π_ref) at the visited states) or ``k3_loss``
            (β·mean of (π_ref/π − 1) − log(π_ref/π) in the loss, as GRPO: the gradient of the
            per-token reverse KL(π_ref‖π)). A loss-side β weighs a per-token mean beside whitened
            advantages, a reward-side β a sum inside the returns: the same β is not the same
            strength across modes.
        precision: ``auto`` (bf16 autocast on CUDA, fp32 on CPU), ``fp32`` or ``bf16`` (autocast
            for the rollout's and the update's forwards; fp32 weights, optimizer state, logits
            and log-softmax; log π_old is recomputed in the update's precision).
        temperature: sampling temperature of the rollout (and of the update's log-probs).
        learning_rate, critic_learning_rate: AdamW step sizes of policy and critic.
        ppo_epochs: passes over each rollout.
        num_minibatches: minibatches per pass.
        clip_epsilon: ε of the clipped surrogate.
        clip_value: ε of the clipped value loss (None: unclipped).
        critic_coef: weight of the value loss.
        gamma, lmbda: GAE discount and λ.
        whiten_rewards: whiten the per-token rewards before GAE.
        max_grad_norm: gradient-norm clip for each model.
        checkpoint_every: iterations between checkpoints (the last one is always saved).
        progress: show a progress bar.
    """

    total_episodes: int = 4096
    num_envs: int = 64
    algo: str = "ppo"
    group_size: int = 8
    seed: int = 0
    device: str = "auto"
    out: str = "runs/ppo"
    resume: bool = False
    model: str | None = None
    reward_model: str | None = None
    prompts: str | None = None
    max_new_tokens: int = 32
    missing_eos_penalty: float = 0.0
    kl_coef: float = DEFAULT_KL_COEF
    target_kl: float | None = 6.0
    kl_horizon: int = 10000
    kl_penalty: str = "k1_reward"
    precision: str = "auto"
    temperature: float = 1.0
    learning_rate: float = 1e-4
    critic_learning_rate: float = 3e-4
    ppo_epochs: int = 4
    num_minibatches: int = 4
    clip_epsilon: float = 0.2
    clip_value: float | None = 0.2
    critic_coef: float = 0.1
    gamma: float = 1.0
    lmbda: float = 0.95
    whiten_rewards: bool = False
    max_grad_norm: float = 1.0
    checkpoint_every: int = 10
    progress: bool = True
    num_iterations: int = field(init=False)
    minibatch_size: int = field(init=False)

    def __post_init__(self) -> None:
        positive_ints = ("total_episodes", "num_envs", "max_new_tokens", "ppo_epochs", "num_minibatches",
                         "checkpoint_every", "kl_horizon", "group_size")  # fmt: skip
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        positive_floats = ("learning_rate", "critic_learning_rate", "clip_epsilon", "max_grad_norm", "temperature")
        for name in positive_floats:
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a finite float > 0")
        check_kl_coef(self.kl_coef)
        for name in ("critic_coef", "missing_eos_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be a finite float >= 0")
        for name in ("gamma", "lmbda"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in [0, 1]")
        if self.target_kl is not None and not (math.isfinite(self.target_kl) and self.target_kl > 0):
            raise ValueError(f"target_kl={self.target_kl!r} must be a float > 0 or None (fixed kl_coef)")
        if self.clip_value is not None and not self.clip_value > 0:
            raise ValueError(f"clip_value={self.clip_value!r} must be > 0 or None")
        if self.kl_penalty not in KL_PENALTIES:
            raise ValueError(
                f"kl_penalty={self.kl_penalty!r} is not one of {KL_PENALTIES}: only k1 belongs in a reward "
                "(k2/k3 as rewards have the wrong expected gradient); k2/k3 enter the loss with their gradient"
            )
        if self.algo not in ALGOS:
            raise ValueError(f"algo={self.algo!r} is not one of {ALGOS}")
        if self.algo != "ppo" and (self.group_size < 2 or self.num_envs % self.group_size):
            raise ValueError(
                f"group_size={self.group_size} must be >= 2 and divide num_envs={self.num_envs} for algo={self.algo!r}"
            )
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"precision={self.precision!r} is not one of 'auto', 'fp32', 'bf16'")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N'")
        if self.num_envs % self.num_minibatches:
            raise ValueError(f"num_envs={self.num_envs} must be divisible by num_minibatches={self.num_minibatches}")
        self.num_iterations = math.ceil(self.total_episodes / self.num_envs)
        self.minibatch_size = self.num_envs // self.num_minibatches

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def env_kwargs(self) -> dict[str, Any]:
        """The ``gym.make`` arguments this config sets."""
        kwargs = {"max_new_tokens": self.max_new_tokens, "kl_coef": self.kl_coef,
                  "missing_eos_penalty": self.missing_eos_penalty}  # fmt: skip
        for name in ("model", "reward_model", "prompts"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return kwargs


# `make demo`: a run that finishes in under 10 minutes on 2 CPU cores and visibly learns.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "demo": {"total_episodes": 3072, "num_envs": 64, "max_new_tokens": 24, "out": "runs/demo",
             "learning_rate": 1e-4, "critic_learning_rate": 1e-3, "kl_coef": 0.1, "target_kl": 10.0,
             "kl_horizon": 1000, "checkpoint_every": 8},
    "tiny": {"total_episodes": 16, "num_envs": 8, "max_new_tokens": 6, "num_minibatches": 2, "ppo_epochs": 1,
             "out": "runs/tiny", "progress": False},
}  # fmt: skip


def _parse_optional(kind):
    def parse(text: str):
        return None if text.lower() in ("none", "null") else kind(text)

    return parse


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """One flag per field (``--total-episodes``; ``none`` for an optional one), plus ``--config PRESET``."""
    parser.add_argument("--config", choices=sorted(PRESETS), default="default", help="preset the flags start from")
    doc = PPOConfig.__doc__ or ""
    for f in fields(PPOConfig):
        if not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = next((line.split(":", 1)[1].strip() for line in doc.splitlines()
                          if line.strip().startswith(f.name + ":")), "")  # fmt: skip
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            base = {"int": int, "float": float, "str": str}[kind.split(" |")[0]]
            parse = _parse_optional(base) if "None" in kind else base
            parser.add_argument(flag, type=parse, default=argparse.SUPPRESS, help=help_text)


def config_from_args(args: argparse.Namespace) -> PPOConfig:
    """Preset values overridden by every flag given on the command line."""
    values = dict(PRESETS[args.config])
    for f in fields(PPOConfig):
        if f.init and hasattr(args, f.name):  # flags not given are absent (SUPPRESS)
            values[f.name] = getattr(args, f.name)
    return PPOConfig(**values)
