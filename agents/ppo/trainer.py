"""PPO for RLHF on TextRLHF-v0, read top to bottom: setup, then rollout → advantages → update → log.

from textgym.agents.ppo import PPOConfig, train
metrics = train(PPOConfig(total_episodes=512, out="runs/x"))
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

import textgym  # noqa: F401  (registers TextRLHF-v0)
from textgym.episodes import collect_episodes
from textgym.functional import gather_logprobs, kl_penalty, masked_mean
from textgym.models import resolve_device
from textgym.policies import LMSampler
from textgym.utils import save_folder_atomically

from ..evaluate import RUN_INFO
from .config import PPOConfig
from .kl import make_kl_controller
from .models import TokenLogits, TokenValues, make_actor, make_critic, make_loss, ppo_diagnostics
from .rollout import compute_advantages, explained_variance, per_token_rewards, sequence_batch

__all__ = ["Trainer", "train"]


@dataclass
class Trainer:
    """Everything a run holds; built by :meth:`Trainer.create`, stepped by :meth:`iteration`."""

    cfg: PPOConfig
    envs: Any
    policy: torch.nn.Module
    critic: torch.nn.Module
    loss: Any
    actor_logits: TokenLogits
    optimizer: torch.optim.Optimizer
    kl_ctl: Any
    sampler: LMSampler
    device: torch.device
    iteration_done: int = 0
    episodes_done: int = 0
    env_steps: int = 0  # tokens generated in training episodes: what every algorithm is charged
    last_beta: float = 0.0  # β of the last rollout: the objective the current policy was updated on
    _last_logits: list = field(default_factory=list)  # the policy logits of the last loss call

    # ------------------------------------------------------------------ setup
    @classmethod
    def create(cls, cfg: PPOConfig, env_overrides: dict[str, Any] | None = None) -> Trainer:
        """Build the env, models, loss and optimizer of ``cfg``.

        ``env_overrides``: further ``gym.make`` arguments no config field carries (the benchmark's
        ``normalize_reward=(mean, std)`` and prompt block), applied over ``cfg.env_kwargs()``.
        """
        device = resolve_device(cfg.device)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        envs = gym.make_vec(
            "TextRLHF-v0",
            num_envs=cfg.num_envs,
            vectorization_mode="vector_entry_point",
            autoreset_mode="disabled",  # one complete episode per slot (collect_episodes)
            device=device,
            **{**cfg.env_kwargs(), **(env_overrides or {})},
        )
        base = envs.unwrapped
        policy = make_actor(base.model)
        critic = make_critic(base.reward_model, policy)
        loss, actor_logits = make_loss(policy, critic, base.max_prompt_tokens, cfg.temperature, cfg.clip_epsilon,
                                       cfg.clip_value, cfg.critic_coef)  # fmt: skip
        optimizer = torch.optim.AdamW(
            [
                {"params": list(policy.parameters()), "lr": cfg.learning_rate},
                {"params": list(critic.parameters()), "lr": cfg.critic_learning_rate},
            ],
            eps=1e-5,
        )
        generator = torch.Generator(device=device).manual_seed(cfg.seed)
        sampler = LMSampler.for_env(policy, envs, temperature=cfg.temperature, generator=generator)
        kl_ctl = make_kl_controller(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon)
        trainer = cls(cfg, envs, policy, critic, loss, actor_logits, optimizer, kl_ctl, sampler, device,
                      last_beta=kl_ctl.value)  # fmt: skip
        actor_logits.register_forward_hook(lambda module, inputs, output: trainer._last_logits.append(output))
        return trainer

    def autocast(self):
        """bf16 autocast for the forwards when ``precision`` asks (``auto``: on CUDA only)."""
        bf16 = self.cfg.precision == "bf16" or (self.cfg.precision == "auto" and self.device.type == "cuda")
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    # ------------------------------------------------------------------ one iteration
    def iteration(self, num_episodes: int | None = None) -> dict[str, float]:
        """Rollout → advantages → update on ``num_episodes`` episodes (default: one per env slot)."""
        cfg, base = self.cfg, self.envs.unwrapped
        t0 = time.perf_counter()

        # -- rollout: the policy samples with its own KV cache, the env scores with π_ref and r_φ
        beta = self.last_beta = self.kl_ctl.value
        base.kl_coef = beta
        timing: dict[str, float] = {}
        episodes = collect_episodes(self.envs, self.sampler, num_episodes=num_episodes, autocast=self.autocast,
                                    seed=cfg.seed if self.iteration_done == 0 else None, timing=timing)  # fmt: skip
        data = sequence_batch(episodes).to(self.device)

        # -- log π_old teacher-forced in the update's precision, so the first minibatch has ratio 1
        sampled = data["sample_log_prob"]
        data["sample_log_prob"] = self._old_logprobs(data)
        mismatch = ((data["sample_log_prob"] - sampled).abs() * data["mask"]).max().item()

        # -- per-token KL-penalised rewards and GAE (one critic forward per sequence)
        in_reward = beta if cfg.kl_penalty == "k1_reward" else 0.0
        reward, log_ratio = per_token_rewards(data["env_reward"], data["sample_log_prob"], data["ref_logprob"],
                                              data["mask"], beta, in_reward)  # fmt: skip
        data["reward"] = reward
        with self.autocast():
            compute_advantages(data, TokenValues(self.critic, base.max_prompt_tokens), cfg.gamma, cfg.lmbda,
                               cfg.whiten_rewards)  # fmt: skip
        t1 = time.perf_counter()

        # -- PPO update: epochs × minibatches of whole sequences
        stats = self._update(data, beta)
        t2 = time.perf_counter()

        # -- KL control and diagnostics
        kl_per_seq = log_ratio.sum(1).mean().item()
        self.kl_ctl.update(kl_per_seq, data.batch_size[0])
        self.iteration_done += 1
        mask = data["mask"]
        tokens = int(mask.sum())
        self.env_steps += tokens
        self.episodes_done += data.batch_size[0]
        return {
            "iteration": self.iteration_done,
            "episodes": self.episodes_done,
            "env_steps": self.env_steps,
            "rm_score": float(episodes["rm_score"].mean()),
            "score": float(episodes["score_reward"].mean()),
            "gold_score": float(np.nanmean(episodes["gold_score"].numpy())),
            "kl": kl_per_seq,
            "beta": beta,
            "response_length": float(mask.float().sum(1).mean()),
            "explained_variance": explained_variance(data["state_value"][..., 0], data["value_target"][..., 0], mask),
            "logprob_mismatch": mismatch,
            **stats,
            "tokens_per_s": tokens / timing["seconds"],
            "time_rollout": timing["seconds"],
            "time_policy_sampling": timing["policy_seconds"],
            "time_advantage": t1 - t0 - timing["seconds"],
            "time_update": t2 - t1,
        }

    @torch.no_grad()
    def _old_logprobs(self, data) -> torch.Tensor:
        """log π_old(a_t|s_t) ``(B, T)`` by teacher forcing in minibatches of the update's size, fp32 log-softmax."""
        out = []
        batch = data.batch_size[0]
        for rows in torch.tensor_split(torch.arange(batch, device=self.device), min(self.cfg.num_minibatches, batch)):
            mb = data[rows]
            with self.autocast():
                logits = self.actor_logits(mb["sequence"], mb["sequence_mask"])  # (b, T, V) fp32
            out.append(gather_logprobs(logits, mb["action"]))
        self._last_logits.clear()
        return torch.cat(out) * data["mask"]

    def _kl_loss(self, mb, beta: float) -> torch.Tensor:
        """β·mean_t k(log π_θ, log π_ref) over valid tokens, with its gradient (``k2_loss``/``k3_loss``)."""
        logp = gather_logprobs(self._last_logits[-1], mb["action"])  # (b, T), differentiable
        per_token = kl_penalty(logp, mb["ref_logprob"], self.cfg.kl_penalty.removesuffix("_loss"))
        return beta * masked_mean(per_token, mb["mask"])

    def _update(self, data, beta: float) -> dict[str, float]:
        cfg = self.cfg
        sums: dict[str, float] = {}
        n_updates = 0
        self.policy.train(False)  # dropout stays off during PPO (N+ implementation details)
        gen = torch.Generator().manual_seed(cfg.seed * 100003 + self.iteration_done)
        batch = data.batch_size[0]
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(batch, generator=gen)
            for rows in torch.tensor_split(order, min(cfg.num_minibatches, batch)):
                mb = data[rows.to(self.device)]
                self._last_logits.clear()
                with self.autocast():
                    out = self.loss(mb)
                total = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
                if cfg.kl_penalty != "k1_reward":
                    out["loss_kl"] = self._kl_loss(mb, beta)
                    total = total + out["loss_kl"]
                self.optimizer.zero_grad(set_to_none=True)
                total.backward()
                torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
                torch.nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
                self.optimizer.step()
                n_updates += 1
                # ClipPPOLoss's own entropy/kl_approx/clip_fraction average over padding too
                diag = ppo_diagnostics(self._last_logits[-1], mb["action"], mb["sample_log_prob"], mb["mask"],
                                       cfg.clip_epsilon)  # fmt: skip
                diag["policy_loss"] = out["loss_objective"].item()
                diag["value_loss"] = out["loss_critic"].item()
                if "loss_kl" in out:
                    diag["kl_loss"] = out["loss_kl"].item()
                for key, value in diag.items():
                    sums[key] = sums.get(key, 0.0) + value
        self._last_logits.clear()
        return {k: v / n_updates for k, v in sums.items()}

    # ------------------------------------------------------------------ checkpoints
    def save(self, out: Path) -> None:
        """``out/checkpoint`` (everything to resume) and plain HF folders ``out/policy``, ``out/value``."""
        tok = self.envs.unwrapped.tokenizer

        def write_checkpoint(tmp: Path) -> None:
            self.policy.save_pretrained(tmp / "policy")
            self.critic.save_pretrained(tmp / "critic")
            state = {
                "iteration": self.iteration_done,
                "env_steps": self.env_steps,
                "episodes": self.episodes_done,
                "optimizer": self.optimizer.state_dict(),
                "kl_controller": self.kl_ctl.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "numpy_rng": np.random.get_state(),
                "python_rng": random.getstate(),
                "sampler_rng": self.sampler.generator.get_state(),
                "env_rng": self.envs.unwrapped.rng_state(),
                "config": self.cfg.to_dict(),
            }
            torch.save(state, tmp / "state.pt")

        save_folder_atomically(out / "checkpoint", write_checkpoint)
        save_folder_atomically(
            out / "policy",
            lambda t: (
                self.policy.save_pretrained(t),
                tok.save_pretrained(t),
                (t / RUN_INFO).write_text(json.dumps(self.run_info())),
            ),
        )
        save_folder_atomically(out / "value", lambda t: (self.critic.save_pretrained(t), tok.save_pretrained(t)))

    def run_info(self) -> dict[str, Any]:
        """What evaluating the saved policy needs to measure the objective it was trained on."""
        cfg = self.cfg
        info = {"kl_coef": self.last_beta, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                "missing_eos_penalty": cfg.missing_eos_penalty, "kl_penalty": cfg.kl_penalty}  # fmt: skip
        return info | {k: getattr(cfg, k) for k in ("model", "reward_model") if getattr(cfg, k) is not None}

    def load(self, ckpt: Path) -> None:
        from safetensors.torch import load_file

        self.policy.load_state_dict(load_file(ckpt / "policy" / "model.safetensors"), strict=False)
        self.critic.load_state_dict(load_file(ckpt / "critic" / "model.safetensors"), strict=False)
        state = torch.load(ckpt / "state.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        random.setstate(state["python_rng"])
        self.sampler.generator.set_state(state["sampler_rng"])
        self.envs.unwrapped.set_rng_state(state["env_rng"])
        self.iteration_done = state["iteration"]
        self.env_steps, self.episodes_done = state["env_steps"], state["episodes"]


def train(cfg: PPOConfig) -> list[dict[str, float]]:
    """Run PPO; writes ``metrics.jsonl``, TensorBoard events and checkpoints under ``cfg.out``."""
    from torch.utils.tensorboard import SummaryWriter
    from tqdm.auto import tqdm

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer.create(cfg)
    metrics_path = out / "metrics.jsonl"
    history: list[dict[str, float]] = []
    if cfg.resume and (out / "checkpoint" / "state.pt").exists():
        trainer.load(out / "checkpoint")
        # keep the metrics up to the checkpoint; drop rows of iterations that were lost
        if metrics_path.exists():
            rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
            history = [r for r in rows if r["iteration"] <= trainer.iteration_done]
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in history))
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    writer = SummaryWriter(str(out / "tensorboard"))
    bar = tqdm(total=cfg.num_iterations, initial=trainer.iteration_done, desc="ppo", disable=not cfg.progress)
    while trainer.iteration_done < cfg.num_iterations:
        row = trainer.iteration()
        history.append(row)
        with metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for key, value in row.items():
            if key != "iteration":
                writer.add_scalar(f"ppo/{key}", value, row["iteration"])
        bar.update()
        bar.set_postfix(score=f"{row['score']:+.2f}", gold=f"{row['gold_score']:+.2f}", kl=f"{row['kl']:.2f}")
        last = trainer.iteration_done == cfg.num_iterations
        if last or trainer.iteration_done % cfg.checkpoint_every == 0:
            trainer.save(out)
    bar.close()
    writer.close()
    trainer.envs.close()
    return history
