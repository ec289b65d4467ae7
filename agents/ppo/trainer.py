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
from textgym.models import resolve_device
from textgym.policies import LMPolicy
from textgym.utils import save_folder_atomically

from .config import PPOConfig
from .kl import make_kl_controller
from .models import ValueHead, make_actor, make_critic, make_loss, ppo_diagnostics
from .rollout import collect, compute_advantages, explained_variance, per_token_rewards

__all__ = ["Trainer", "train"]


@dataclass
class Trainer:
    """Everything a run holds; built by :meth:`Trainer.create`, stepped by :meth:`iteration`."""

    cfg: PPOConfig
    envs: Any
    policy: torch.nn.Module
    critic: torch.nn.Module
    loss: Any
    optimizer: torch.optim.Optimizer
    kl_ctl: Any
    sampler: LMPolicy
    device: torch.device
    iteration_done: int = 0
    _last_logits: list = field(default_factory=list)  # the LM head's output of the last loss call

    # ------------------------------------------------------------------ setup
    @classmethod
    def create(cls, cfg: PPOConfig) -> Trainer:
        device = resolve_device(cfg.device)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        envs = gym.make_vec(
            "TextRLHF-v0",
            num_envs=cfg.num_envs,
            vectorization_mode="vector_entry_point",
            autoreset_mode="next_step",
            device=device,
            **cfg.env_kwargs(),
        )
        base = envs.unwrapped
        policy = make_actor(base.model)
        critic = make_critic(base.reward_model, policy)
        loss, lm_head = make_loss(policy, critic, base.max_prompt_tokens, cfg.temperature, cfg.clip_epsilon,
                         cfg.clip_value, cfg.critic_coef)  # fmt: skip
        optimizer = torch.optim.AdamW(
            [
                {"params": list(policy.parameters()), "lr": cfg.learning_rate},
                {"params": list(critic.parameters()), "lr": cfg.critic_learning_rate},
            ],
            eps=1e-5,
        )
        generator = torch.Generator(device=device).manual_seed(cfg.seed)
        sampler = LMPolicy.for_env(policy, envs, temperature=cfg.temperature, generator=generator)
        kl_ctl = make_kl_controller(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon)
        trainer = cls(cfg, envs, policy, critic, loss, optimizer, kl_ctl, sampler, device)
        lm_head.register_forward_hook(lambda module, inputs, output: trainer._last_logits.append(output.detach()))
        return trainer

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ one iteration
    def iteration(self) -> dict[str, float]:
        cfg, base = self.cfg, self.envs.unwrapped
        t0 = time.perf_counter()

        # -- rollout: the policy samples with its own KV cache, the env scores with π_ref and r_φ
        beta = self.kl_ctl.value
        base.kl_coef = beta
        self.sampler.reset()
        batch = collect(self.envs, self.sampler, seed=cfg.seed if self.iteration_done == 0 else None,
                        autocast=self.autocast)  # fmt: skip
        data = batch.data.to(self.device)

        # -- per-token KL-penalised rewards and GAE (one critic forward per sequence)
        reward, kl = per_token_rewards(data["env_reward"], data["sample_log_prob"], data["ref_logprob"],
                                       data["mask"], beta, beta, cfg.kl_estimator)  # fmt: skip
        data["reward"] = reward
        value_fn = ValueHead(self.critic, base.max_prompt_tokens)
        with self.autocast():
            compute_advantages(data, value_fn, cfg.gamma, cfg.lmbda, cfg.whiten_rewards)
        t1 = time.perf_counter()

        # -- PPO update: epochs × minibatches of whole sequences
        stats = self._update(data)
        t2 = time.perf_counter()

        # -- KL control and diagnostics
        kl_per_seq = kl.sum(1).mean().item()
        self.kl_ctl.update(kl_per_seq, cfg.num_envs)
        self.iteration_done += 1
        mask = data["mask"]
        tokens = int(mask.sum())
        return {
            "iteration": self.iteration_done,
            "episodes": self.iteration_done * cfg.num_envs,
            "rm_score": float(batch.rm_score.mean()),
            "score": float(batch.score_reward.mean()),
            "gold_score": float(np.nanmean(batch.gold_score)) if np.isfinite(batch.gold_score).any() else float("nan"),
            "kl": kl_per_seq,
            "beta": beta,
            "response_length": float(mask.float().sum(1).mean()),
            "explained_variance": explained_variance(data["state_value"][..., 0], data["value_target"][..., 0], mask),
            **stats,
            "tokens_per_s": tokens / batch.seconds,
            "time_rollout": batch.seconds,
            "time_policy_sampling": batch.policy_seconds,
            "time_advantage": t1 - t0 - batch.seconds,
            "time_update": t2 - t1,
        }

    def _update(self, data) -> dict[str, float]:
        cfg = self.cfg
        sums: dict[str, float] = {}
        n_updates = 0
        self.policy.train(False)  # dropout stays off during PPO (N+ implementation details)
        gen = torch.Generator().manual_seed(cfg.seed * 100003 + self.iteration_done)
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(cfg.num_envs, generator=gen)
            for start in range(0, cfg.num_envs, cfg.minibatch_size):
                mb = data[order[start : start + cfg.minibatch_size].to(self.device)]
                self._last_logits.clear()
                with self.autocast():
                    out = self.loss(mb)
                total = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
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
                for key, value in diag.items():
                    sums[key] = sums.get(key, 0.0) + value
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
        save_folder_atomically(out / "policy", lambda t: (self.policy.save_pretrained(t), tok.save_pretrained(t)))
        save_folder_atomically(out / "value", lambda t: (self.critic.save_pretrained(t), tok.save_pretrained(t)))

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
