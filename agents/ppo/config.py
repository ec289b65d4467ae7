"""The one typed config of the PPO agent; every field is a ``textgym train`` flag."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from textgym.decoders import DECODERS
from textgym.envs.checks import DEFAULT_KL_COEF, check_kl_coef
from textgym.envs.settings import ENV_FIELDS, EnvSettings

__all__ = ["KL_PENALTIES", "LR_SCHEDULES", "PPOConfig", "PRESETS", "PRESET_DIR", "RESUME_APPLIED", "RESUME_FREE",
           "add_config_args", "config_from_args", "field_defaults", "load_config_file"]  # fmt: skip

KL_PENALTIES = ("k1_reward", "k2_loss", "k3_loss")
ALGOS = ("ppo", "grpo", "rloo")
GROUP_SCALES = ("std", "none")  # grpo_scale: GRPO's score over the group's std, or only centred (Dr. GRPO)
LR_SCHEDULES = ("constant", "linear", "cosine")  # transformers' schedulers, after `warmup_iterations`
# On resume: fields that may change and are applied from the resumed iteration on (the optimizer's
# learning rates are set again after its state loads), and fields that do not touch the run's numbers.
# Every other field defines the run (models, env, seed, algorithm): a change is refused.
# `textgym train --help` lists the fields in these groups; a config file stays one flat JSON object.
FIELD_GROUPS = {
    "algorithm": ("algo", "group_size", "grpo_scale", "kl_coef", "target_kl", "kl_horizon", "kl_penalty", "tis_cap",
                  "ppo_epochs", "num_minibatches", "clip_epsilon", "clip_value", "critic_coef", "gamma", "lmbda",
                  "whiten_rewards", "max_grad_norm", "early_stop_kl"),
    "optimiser": ("learning_rate", "critic_learning_rate", "lr_schedule", "warmup_iterations", "lora_rank",
                  "lora_alpha", "merged_rollout"),
    "env (the task)": ENV_FIELDS,  # textgym.envs.settings.EnvSettings: the one list
    "sampling": ("temperature", "top_k", "top_p"),
    "run": ("total_episodes", "num_envs", "seed", "device", "precision", "gradient_checkpointing", "decoder", "threads",
            "deterministic", "out", "resume",
            "checkpoint_every", "progress", "report_to", "samples_every", "num_samples", "eval_every",
            "eval_episodes"),
    "cluster (Ray rollout workers)": ("num_workers", "ray_address", "async_rollout"),
}  # fmt: skip
CHOICES = {"algo": ALGOS, "grpo_scale": GROUP_SCALES, "kl_penalty": KL_PENALTIES, "lr_schedule": LR_SCHEDULES,
           "precision": ("auto", "fp32", "bf16"), "decoder": DECODERS}  # fmt: skip
RESUME_APPLIED = ("total_episodes", "learning_rate", "critic_learning_rate", "early_stop_kl")
RESUME_FREE = ("out", "resume", "checkpoint_every", "progress", "samples_every", "num_samples", "eval_every",
               "eval_episodes", "ray_address", "report_to", "reward_timeout", "partner_timeout",
               "gradient_checkpointing")  # fmt: skip


@dataclass
class PPOConfig(EnvSettings):
    """PPO for RLHF on TextRLHF-v0; defaults after TRL and "The N+ Implementation Details of
    RLHF with PPO" (Huang et al., 2024).

    Attributes:
        total_episodes: episodes (prompt + response) to train on.
        num_envs: env slots = episodes per rollout (the PPO batch).
        algo: ``ppo`` (clipped surrogate, GAE over a learned critic), ``grpo`` (no critic: each
            episode's score minus its group's mean, over the group's score std, plus its k1 KL return
            centred in the group with β unscaled; Shao et al., 2024) or ``rloo`` (no critic: the
            return minus the mean of the other G − 1 returns of its group, an unbiased baseline;
            Ahmadian et al., 2024). See ``textgym.agents.ppo.advantages.group_advantages``.
        group_size: G, episodes per prompt for ``grpo``/``rloo`` (``num_envs`` holds
            ``num_envs / G`` groups).
        grpo_scale: ``std`` divides GRPO's centred scores by the group's own score std (GRPO's
            self-normalised estimator, biased, with no closed-form objective); ``none`` only centres
            them (Dr. GRPO, Liu et al., 2025: the update follows E[score] − β·KL exactly).
        seed: seeds the env, the sampling and the model initialisation.
        device: ``auto``, ``cpu`` or ``cuda`` (see ``precision``).
        threads: torch's CPU threads for the run (None: ``OMP_NUM_THREADS`` if set, else one per core this
            process may use, as ``import textgym`` sets them with OpenMP's passive wait policy, so that a busy
            core costs little; never a reading of the machine's load); recorded
            in ``config.json`` and reused by ``--resume``, since another thread count rounds differently
            and the run would no longer repeat itself.
        deterministic: also make torch use only deterministic algorithms (an op without one raises).
        out: output folder (metrics, TensorBoard events, checkpoints, HF folders).
        resume: continue the run in ``out`` from its checkpoint; changing a field that defines the run is refused.
            total_episodes, learning_rate, critic_learning_rate and early_stop_kl may change (applied from the
            resumed iteration on); out, checkpoint_every, progress, report_to, samples_every, num_samples,
            eval_every, eval_episodes, ray_address, reward_timeout, partner_timeout and gradient_checkpointing
            freely; a folder without a run starts one.
        (the env's fields: :class:`textgym.envs.settings.EnvSettings`)
        kl_coef: initial β (the env's default, ``textgym.envs.DEFAULT_KL_COEF``).
        target_kl: per-sequence KL target of the adaptive controller; None keeps β fixed. The KL is the
            sampling distribution's: under top_k/top_p it includes the truncation's own KL to π_ref (> 0 at
            initialisation; docs/training.md), so the target must exceed it.
        kl_horizon: horizon (in episodes) of the adaptive controller (Ziegler et al., 2019).
        kl_penalty: how β·KL(π‖π_ref) enters: ``k1_reward`` (default: −β·log(π_old/π_ref) in each
            token's reward; its expected gradient is exactly that of the KL-regularised
            objective), ``k2_loss`` (β·mean ½·log²(π/π_ref) in the loss, with its gradient: the
            gradient of the per-token forward KL(π‖π_ref) at the visited states) or ``k3_loss``
            (β·mean of (π_ref/π − 1) − log(π_ref/π) in the loss, as GRPO: the gradient of the
            per-token reverse KL(π_ref‖π)). A loss-side β weighs a per-token mean beside whitened
            advantages, a reward-side β a sum inside the returns: the same β is not the same
            strength across modes.
        precision: ``auto`` (bf16 where the device computes it natively: CUDA, or a CPU with AVX-512 BF16
            or AMX; else fp32), ``fp32`` or ``bf16`` (autocast for the policy's rollout forwards and the
            update's forwards; fp32 weights, optimizer state, logits and log-softmax; log π_old is recomputed
            in the update's precision; π_ref and the reward model in the env stay in their own precision).
        gradient_checkpointing: keep only each decoder layer's input for the backward of the policy and the
            critic and recompute the layer there (transformers' non-reentrant checkpointing; the layers alone
            are put in training mode for it, every other module stays in eval mode): the update's activations
            shrink about 13x at SmolLM2's shape for one more forward per minibatch; the numbers are the same
            (tested). For long contexts (conversations): docs/performance.md, "Memory".
        decoder: the rollout sampler's KV cache (``textgym.ring_decoder``): ``ring`` (preallocated, a decode step
            of fixed shapes), ``graph`` (the ring's step replayed as a CUDA graph; CUDA only), ``dynamic`` (a
            ``DynamicCache`` grown by one column per step), ``auto`` (the ring; ``graph`` until its replay is checked
            on a GPU is asked for by name). The same
            distribution in each; the logits differ by float rounding (a softmax summed in another order).
        tis_cap: cap C of the truncated importance weight min(π_old/π_sampler, C) on each token's
            policy-gradient term, where π_old is the update's teacher-forced log-prob and π_sampler
            the one the rollout drew the token with (they differ by rounding, most under bf16:
            Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL
            training"); None: no correction.
        temperature: sampling temperature of the rollout (and of the update's log-probs).
        top_k: sample among the k most likely tokens only (None: all); the update's log-probs use the same
            truncated distribution, so the first ratio stays 1.
        top_p: sample from the smallest set of tokens whose probability reaches p (nucleus; None: all),
            after temperature and top_k, as Hugging Face ``generate`` orders them.
        learning_rate: the policy's AdamW step size.
        critic_learning_rate: the critic's AdamW step size (PPO; GRPO and RLOO have no critic).
        lora_rank: 0 trains every weight; R > 0 trains LoRA adapters of rank R (peft) on every linear
            layer of the env's own π_ref model, whose π_ref forwards run with the adapters disabled:
            one copy of the base weights serves π_ref and the policy. The critic is then the reward
            model's (small) backbone when it shares the tokenizer, else a frozen copy of the body with
            its own adapters and a value head.
        lora_alpha: LoRA scaling numerator, the update scaled by alpha/R (None: 2·R).
        merged_rollout: with LoRA, the rollout samples from a copy of the policy with the adapters merged into
            its weights (``agents/ppo/merged_policy.py``; refreshed before each rollout): one matmul per linear
            instead of three, for one more base model in memory. None: on CUDA only.
        lr_schedule: ``constant``, ``linear`` or ``cosine`` decay to 0 over the run (transformers' schedulers),
            in iterations, after the warmup.
        warmup_iterations: iterations of linear learning-rate warmup from 0 (0: none).
        early_stop_kl: end an iteration's PPO epochs after the first epoch whose mean approx_kl exceeds it
            (CleanRL's and SB3's target_kl; None: never). A pretrained LM can move far in one update.
        ppo_epochs: passes over each rollout.
        num_minibatches: minibatches per pass.
        clip_epsilon: ε of the clipped surrogate.
        clip_value: ε of the clipped value loss (None: unclipped).
        critic_coef: weight of the value loss.
        gamma: GAE's discount γ (1.0: an episode's tokens are not discounted).
        lmbda: GAE's λ, the bias-variance trade-off of the advantage (1.0: Monte Carlo returns minus V).
        whiten_rewards: whiten the per-token rewards before GAE.
        max_grad_norm: gradient-norm clip for each model.
        checkpoint_every: iterations between checkpoints (the last one is always saved).
        progress: show a progress bar.
        report_to: where metrics, samples and the config go besides the run folder: a comma-separated list of
            ``tensorboard`` (``OUT/tensorboard``), ``wandb``, ``mlflow``, or ``none`` (see ``reporting``).
        samples_every: iterations between writing sample completions to ``samples.jsonl`` and TensorBoard (0: never).
        num_samples: completions written each time (the first episodes of the rollout).
        eval_every: iterations between evaluations on the held-out eval prompts (0: never); the results join
            that iteration's metrics as ``eval_*``.
        eval_episodes: episodes per evaluation.
        num_workers: K > 0 collects each rollout on K Ray actors, each with its own env (π_ref and the reward
            model) over num_envs / K of the slots and a policy copy loaded from one ``ray.put`` of the weights per
            iteration; 0 collects in this process. Same seed and K give the same run (``pip install textgym[ray]``).
        ray_address: the Ray cluster the workers join (``ray start --head`` prints it; ``auto``: the one this node
            belongs to); None starts an embedded local cluster.
        async_rollout: with num_workers > 0, the workers collect iteration i+1 with the weights of iteration i
            while the learner updates (one-step off-policy: the ratio uses the sampling policy's log-probs).
    """

    total_episodes: int = 4096
    num_envs: int = 64
    algo: str = "ppo"
    group_size: int = 8
    grpo_scale: str = "std"
    seed: int = 0
    device: str = "auto"
    threads: int | None = None
    deterministic: bool = False
    out: str = "runs/ppo"
    resume: bool = False
    kl_coef: float = DEFAULT_KL_COEF
    target_kl: float | None = 6.0
    kl_horizon: int = 10000
    kl_penalty: str = "k1_reward"
    precision: str = "auto"
    gradient_checkpointing: bool = False
    decoder: str = "auto"
    tis_cap: float | None = 2.0
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    learning_rate: float = 1e-4
    critic_learning_rate: float = 3e-4
    lora_rank: int = 0
    lora_alpha: float | None = None
    merged_rollout: bool | None = None
    lr_schedule: str = "constant"
    warmup_iterations: int = 0
    early_stop_kl: float | None = None
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
    report_to: str = "tensorboard"
    samples_every: int = 10
    num_samples: int = 4
    eval_every: int = 0
    eval_episodes: int = 64
    num_workers: int = 0
    ray_address: str | None = None
    async_rollout: bool = False
    num_iterations: int = field(init=False)
    minibatch_size: int = field(init=False)

    def __post_init__(self) -> None:
        _check_scorers_are_names(self)  # before the type check: a function here has a fix to name
        check_field_types(self)  # first: "false" for a bool is truthy, and "1e-4" fails later inside a model
        self.check_env_settings()
        positive_ints = ("total_episodes", "num_envs", "ppo_epochs", "num_minibatches",
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
        if not math.isfinite(self.critic_coef) or self.critic_coef < 0:
            raise ValueError(f"critic_coef={self.critic_coef!r} must be a finite float >= 0")
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
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 0:
            raise ValueError(f"lora_rank={self.lora_rank!r} must be an int >= 0 (0: train every weight)")
        if self.lora_alpha is not None and not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ValueError(f"lora_alpha={self.lora_alpha!r} must be a finite float > 0 or None (2 x lora_rank)")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"precision={self.precision!r} is not one of 'auto', 'fp32', 'bf16'")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N'")
        if self.num_envs % self.num_minibatches:
            raise ValueError(f"num_envs={self.num_envs} must be divisible by num_minibatches={self.num_minibatches}")
        self._check_additions()
        self.num_iterations = math.ceil(self.total_episodes / self.num_envs)
        self.minibatch_size = self.num_envs // self.num_minibatches

    def _check_additions(self) -> None:
        """Sampling truncation, the learning-rate schedule, the early stop and the periodic logging."""
        for name in ("warmup_iterations", "samples_every", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0 (0: off)")
        for name in ("num_samples", "eval_episodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        top_k = self.top_k
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
            raise ValueError(f"top_k={self.top_k!r} must be an int >= 1 or None (every token)")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be a float in (0, 1] or None (every token)")
        if self.grpo_scale not in GROUP_SCALES:
            raise ValueError(f"grpo_scale={self.grpo_scale!r} is not one of {GROUP_SCALES}")
        if self.tis_cap is not None and not (math.isfinite(self.tis_cap) and self.tis_cap >= 1):
            raise ValueError(f"tis_cap={self.tis_cap!r} must be a finite float >= 1 or None (no correction)")
        threads = self.threads
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise ValueError(f"threads={threads!r} must be an int >= 1 or None (one per core)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r} is not one of {LR_SCHEDULES}")
        if self.early_stop_kl is not None and not (math.isfinite(self.early_stop_kl) and self.early_stop_kl > 0):
            raise ValueError(f"early_stop_kl={self.early_stop_kl!r} must be a finite float > 0 or None (never stop)")
        from .reporting import check_reporters  # names and installed packages only: no backend imported

        check_reporters(self.report_to)
        self._check_rollout_model()

    def _check_rollout_model(self) -> None:
        """The rollout's KV cache and its LoRA merge."""
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder={self.decoder!r} is not one of {DECODERS}")
        if self.decoder == "graph" and self.device == "cpu":
            raise ValueError("decoder='graph' captures CUDA graphs; device='cpu' (use 'ring' or 'auto')")
        if self.merged_rollout and not self.lora_rank:
            raise ValueError("merged_rollout=True merges LoRA adapters into a copy; lora_rank=0 trains every weight")
        self._check_workers()

    def _check_workers(self) -> None:
        """Ray rollout workers: a count that gives every worker a slot, and settings that need workers."""
        k = self.num_workers
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= self.num_envs:
            raise ValueError(f"num_workers={k!r} must be an int in [0, num_envs={self.num_envs}] (0: in process)")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address):
            raise ValueError(f"ray_address={self.ray_address!r} must be a non-empty str or None (a local cluster)")
        if self.ray_address is not None and k == 0:
            raise ValueError(f"ray_address={self.ray_address!r} is set but num_workers=0 collects in process; "
                             "give num_workers >= 1 to use the cluster")  # fmt: skip
        if self.async_rollout and k == 0:
            raise ValueError("async_rollout=True needs num_workers >= 1 (got num_workers=0): the rollout overlaps "
                             "the update only when other processes collect it")  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    def env_kwargs(self) -> dict[str, Any]:
        """The ``gym.make`` arguments this config sets: its env settings' and β."""
        return {**super().env_kwargs(), "kl_coef": self.kl_coef}


def _check_scorers_are_names(cfg: PPOConfig) -> None:
    """Refuse a reward model given as an object or function, naming ``register()``, the way to train on one.

    Why: ``gym.make(..., reward_model=f)`` takes a function, so users pass one here too; but a config is
    saved as JSON and read again by a resume, Ray workers and ``textgym eval``, so it holds a name.

    Raises:
        ValueError: naming the field, the value and ``textgym.rewards.register``.
    """
    for name in ("reward_model", "gold_scorer"):
        value = getattr(cfg, name)
        if value is not None and not isinstance(value, str) and (callable(value) or hasattr(value, "score")):
            raise ValueError(
                f"{name}={value!r} is a reward model object, not a name: the config is saved as JSON; register it "
                f"with textgym.rewards.register('my-rm', lambda: ...) and pass {name}='my-rm' (or a path, URL or "
                "'module:attr'); the env itself, gym.make(..., reward_model=...), takes the object"
            )


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}  # annotation -> accepted types


def check_field_types(cfg: Any) -> None:
    """Refuse a field whose value is not of its annotated type, naming the field, the value and the type.

    Why: a config file is JSON, where ``"false"`` is a truthy string and ``"1e-4"`` is no number; a
    bool is an int to Python, but ``num_envs=true`` is a mistake. Annotations other than these plain
    types (and their ``| None``) are left to the field's own check.

    Raises:
        ValueError: ``"{field}={value!r} is a {type}; {field} takes a {type}"``.
    """
    for f in fields(cfg):
        if not f.init:
            continue
        parts = [p.strip() for p in str(f.type).split("|")]
        optional = "None" in parts
        kinds = [p for p in parts if p != "None"]
        if len(kinds) != 1 or kinds[0] not in _TYPES:
            continue
        value = getattr(cfg, f.name)
        if value is None and optional:
            continue
        ok = isinstance(value, _TYPES[kinds[0]]) and (kinds[0] == "bool" or not isinstance(value, bool))
        if not ok:
            allowed = kinds[0] + (" or None" if optional else "")
            given = type(value).__name__
            raise ValueError(
                f"{f.name}={value!r} is {_article(given)} {given}; {f.name} takes {_article(allowed)} {allowed}"
            )


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


PRESET_DIR = Path(__file__).parent / "presets"  # one JSON file per preset: copy one to start your own


def field_defaults() -> dict[str, Any]:
    """Every settable field's default (what a config file or a saved run without the field ran with)."""
    return {f.name: f.default for f in fields(PPOConfig) if f.init and f.default is not MISSING}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The field values of a JSON config file (a preset, or a run's ``OUT/config.json``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a JSON object, or names a field ``PPOConfig`` does not have.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config_file={str(path)!r} does not exist; give a JSON file such as OUT/config.json")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"config_file={str(path)!r} is not valid JSON ({err})") from err
    if not isinstance(values, dict):
        raise ValueError(f"config_file={str(path)!r} holds {type(values).__name__}; it must be a JSON object of fields")
    unknown = sorted(set(values) - set(field_defaults()))
    if unknown:
        raise ValueError(f"config_file={str(path)!r} has unknown fields {unknown}; allowed: {sorted(field_defaults())}")
    return values


# `make demo` (demo.json): a run that finishes in under 10 minutes on 2 CPU cores and visibly learns.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    **{path.stem: load_config_file(path) for path in sorted(PRESET_DIR.glob("*.json"))},
}


def plain_text(doc: str) -> str:
    """A docstring entry as ``--help`` shows it: ``code`` and :role:`target` as their bare text."""
    return re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "")


def attribute_docs(doc: str) -> dict[str, str]:
    """Each name's whole entry in a Google-style docstring's ``Attributes:`` section, one line per entry.

    An entry is its ``name:`` line plus every following line indented deeper (a wrapped sentence),
    so ``--help`` shows whole sentences; ``a, b: text`` documents both names.
    """
    lines = doc.expandtabs().splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.strip() == "Attributes:"), len(lines))
    entries: dict[str, str] = {}
    names: list[str] = []
    indent = None
    for line in lines[start:]:
        depth = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        if indent is None:
            indent = depth
        if depth < indent:
            break  # the section ended
        if depth == indent:
            head, _, text = line.strip().partition(":")
            names = [name.strip() for name in head.split(",")]
            for name in names:
                entries[name] = text.strip()
        else:
            for name in names:
                entries[name] += " " + line.strip()
    return entries


def _parse_optional(kind):
    def parse(text: str):
        return None if text.lower() in ("none", "null") else kind(text)

    return parse


def _parse_bool(text: str) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``) for a flag that can also be ``none``."""
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false or none")
    return words[text.lower()]


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """One flag per field (``--total-episodes``; ``none`` for an optional one), ``--config`` and ``--config-file``."""
    parser.add_argument("--config", choices=sorted(PRESETS), default="default",
                        help=f"preset the flags start from (files in {PRESET_DIR})")  # fmt: skip
    parser.add_argument("--config-file", default=None, help="a JSON file of fields (a copied preset, or a run's "
                        "OUT/config.json), applied over the preset; flags given apply over it")  # fmt: skip
    docs = {**attribute_docs(EnvSettings.__doc__ or ""), **attribute_docs(PPOConfig.__doc__ or "")}
    defaults = field_defaults()
    types = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in fields(PPOConfig) if f.init}
    for title, names in FIELD_GROUPS.items():
        group = parser.add_argument_group(title)
        for name in names:
            flag = "--" + name.replace("_", "-")
            help_text = f"{plain_text(docs.get(name, ''))} (default: {defaults[name]})".replace("%", "%%")
            kind = types[name]
            if kind == "bool":
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                   help=help_text)  # fmt: skip
                continue
            base = {"int": int, "float": float, "str": str, "bool": _parse_bool}[kind.split(" |")[0]]
            parse = _parse_optional(base) if "None" in kind else base
            group.add_argument(flag, type=parse, default=argparse.SUPPRESS, help=help_text, choices=CHOICES.get(name))


def config_from_args(args: argparse.Namespace) -> PPOConfig:
    """Preset values, then the ``--config-file``'s, then every flag given on the command line."""
    values = dict(PRESETS[args.config])
    if getattr(args, "config_file", None):
        values.update(load_config_file(args.config_file))
    for f in fields(PPOConfig):
        if f.init and hasattr(args, f.name):  # flags not given are absent (SUPPRESS)
            values[f.name] = getattr(args, f.name)
    return PPOConfig(**values)
