"""PPO for RLHF on TextRLHF-v0, read top to bottom: setup, then rollout → advantages → update → log.

The algorithm alone: where the episodes come from (:mod:`.sources`), how advantages are estimated
(:mod:`.algorithms`: PPO's critic, GRPO's and RLOO's groups), what a checkpoint's files hold
(:mod:`.checkpoint`) and how a run folder is kept (:mod:`.run_folder`, driven by :func:`.run.train`)
each live in their own module.

from textgym.agents.ppo import PPOConfig, Trainer
trainer = Trainer.create(PPOConfig(total_episodes=512, out="runs/x"))
row = trainer.iteration()
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from textgym.episodes import episode_score, sequence_kl
from textgym.files import save_folder_atomically
from textgym.functional import kl_penalty, masked_mean
from textgym.models import native_bf16, resolve_device
from textgym.policies import LMSampler
from textgym.threads import use_threads

from . import checkpoint, distributed
from .advantages import per_token_rewards, sampler_mismatch, sequence_batch, trim_columns
from .algorithms import make_estimator
from .calibration import run_norm
from .config import PPOConfig
from .envs import make_envs
from .guards import check_finite, check_finite_weights, check_memory
from .kl import make_kl_controller
from .merged_policy import MergedPolicy, merges_lora
from .models import (
    TokenLogProbs,
    make_loss,
    make_policy,
    ppo_diagnostics,
    set_update_mode,
    trainable,
)
from .sources import make_rollouts

__all__ = ["Trainer"]


# TorchRL's loss keys and the one name each term goes by here: metrics, errors, logs
LOSS_TERMS = {"loss_objective": "policy_loss", "loss_critic": "value_loss", "loss_kl": "kl_loss"}


@dataclass
class Trainer:
    """Everything a run holds; built by :meth:`Trainer.create`, stepped by :meth:`iteration`."""

    cfg: PPOConfig
    envs: Any
    policy: torch.nn.Module
    critic: torch.nn.Module | None  # None for the critic-free GRPO and RLOO
    estimator: Any  # the advantages: CriticGAE (PPO) or GroupBaseline (GRPO, RLOO)
    loss: Any
    actor_logprobs: TokenLogProbs
    optimizer: torch.optim.Optimizer
    kl_ctl: Any
    sampler: LMSampler
    device: torch.device
    iteration_done: int = 0
    episodes_done: int = 0
    env_steps: int = 0  # tokens generated in training episodes: what every algorithm is charged
    last_beta: float = 0.0  # β of the last rollout: the objective the current policy was updated on
    _last_logprobs: list = field(default_factory=list)  # (log-probs, entropies, tokens) of the last loss call
    lr_factor: Any = None  # iteration -> learning-rate multiplier (warmup, then the schedule's decay)
    env_overrides: dict = field(default_factory=dict)  # gym.make arguments beyond the config's (the benchmark's)
    last_episodes: Any = None  # the last rollout's episodes (for the logged samples)
    rollouts: Any = None  # where episodes come from (.sources): this process or Ray workers; rank 0 only
    merged: MergedPolicy | None = None  # a LoRA policy's merged copy the sampler reads (merged_rollout)

    # ------------------------------------------------------------------ setup
    @classmethod
    def create(cls, cfg: PPOConfig, env_overrides: dict[str, Any] | None = None) -> Trainer:
        """Build the env, models, loss and optimizer of ``cfg``.

        ``env_overrides``: further ``gym.make`` arguments no config field carries (the benchmark's
        ``normalize_reward=(mean, std)`` and prompt block), applied over ``cfg.env_kwargs()``.
        """
        device = distributed.init(resolve_device(cfg.device))  # under torchrun: this rank's device
        if cfg.threads is not None or cfg.deterministic:
            use_threads(cfg.threads, cfg.deterministic)  # before any model: the run's rounding depends on it
        # the RM standardised at this run's length cap (before the seeds: calibration has its own)
        env_overrides = {**run_norm(cfg, device, env_overrides), **(env_overrides or {})}
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        envs = make_envs(cfg, cfg.num_envs, device, env_overrides)
        base = envs.unwrapped
        check_memory(cfg, base.max_prompt_tokens)  # again, with the prompt block the env sized (openings: 185-1100)
        # the scale this run pays, given explicitly from here on: Ray workers, eval and a resume use it as it is,
        # never a second reading of a server's /health that may answer otherwise (or not at all)
        norm = base.reward_norm
        env_overrides["normalize_reward"] = False if norm is None else (norm.mean, norm.std)
        policy = make_policy(cfg, base)
        estimator = make_estimator(cfg, base.reward_model, policy, base.max_prompt_tokens)
        critic = estimator.critic  # GRPO/RLOO: none
        # under torchrun the loss calls the models through DDP (gradients all-reduced); saved are the bare ones
        truncated = cfg.top_k is not None or cfg.top_p is not None  # the update reads the sampler's kept sets
        loss, actor_logprobs = make_loss(distributed.wrap(policy, device), distributed.wrap(critic, device),
                                       base.max_prompt_tokens, cfg.temperature, cfg.clip_epsilon, cfg.clip_value,
                                       cfg.critic_coef, truncated)  # fmt: skip
        groups = [{"params": trainable(policy), "lr": cfg.learning_rate}]
        if critic is not None:
            groups.append({"params": trainable(critic), "lr": cfg.critic_learning_rate})
        # fused: one kernel over all parameters instead of a foreach loop (CPU and CUDA; docs/performance.md)
        optimizer = torch.optim.AdamW(groups, eps=1e-5, fused=device.type in ("cpu", "cuda"))
        generator = torch.Generator(device=device).manual_seed(cfg.seed)
        merges = merges_lora(cfg.merged_rollout, cfg.lora_rank, device)
        merged = MergedPolicy(policy) if merges else None  # the rollout samples from a plain merged copy
        sampler = LMSampler.for_env(policy if merged is None else merged.model, envs, temperature=cfg.temperature,
                                    generator=generator, top_k=cfg.top_k, top_p=cfg.top_p,
                                    decoder=cfg.decoder)  # fmt: skip
        kl_ctl = make_kl_controller(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon)
        trainer = cls(cfg, envs, policy, critic, estimator, loss, actor_logprobs, optimizer, kl_ctl, sampler, device,
                      last_beta=kl_ctl.value, lr_factor=lr_schedule(cfg),
                      env_overrides=dict(env_overrides or {}), merged=merged)  # fmt: skip
        last = trainer._last_logprobs  # the hook holds the list, not the trainer: no cycle keeps a dropped one alive
        actor_logprobs.register_forward_hook(lambda module, inputs, output: last.append(output))
        if distributed.is_main():  # rank 0 collects every rollout
            trainer.rollouts = make_rollouts(cfg, envs, trainer.autocast, trainer.env_overrides, device, trainer.bf16)
        return trainer

    @property
    def bf16(self) -> bool:
        """Whether the forwards run under bf16 autocast: ``precision="bf16"``, or ``auto`` on native-bf16 hardware."""
        return self.cfg.precision == "bf16" or (self.cfg.precision == "auto" and native_bf16(self.device))

    def autocast(self):
        """bf16 autocast for the forwards when ``precision`` asks (``auto``: where the device has native bf16)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    # ------------------------------------------------------------------ one iteration
    def iteration(self, num_episodes: int | None = None) -> dict[str, float]:
        """Rollout → advantages → update on ``num_episodes`` episodes (default: one per env slot)."""
        cfg, base = self.cfg, self.envs.unwrapped
        t0 = time.perf_counter()

        # -- rollout: the policy samples with its own KV cache, the env scores with π_ref and r_φ
        beta = self.last_beta = self.kl_ctl.value
        base.kl_coef = beta
        timing: dict[str, float] = {}
        seed = cfg.seed if self.iteration_done == 0 else None
        episodes = self._collect(num_episodes, seed, timing)
        self.last_episodes = episodes
        data = trim_columns(sequence_batch(episodes), base.max_prompt_tokens).to(self.device)

        # -- log π_old teacher-forced in the update's precision (first minibatch: ratio 1); the sampler's gap to it
        weight, mismatch = self._pi_old(data)

        # -- per-token KL-penalised rewards; advantages by GAE over the critic (PPO) or by groups
        in_reward = beta if cfg.kl_penalty == "k1_reward" else 0.0
        reward, log_ratio = per_token_rewards(data["env_reward"], data["sample_log_prob"], data["ref_logprob"],
                                              data["mask"], beta, in_reward)  # fmt: skip
        data["reward"] = reward
        advantage_stats = self.estimator.advantages(data, episodes, log_ratio, in_reward, self.autocast)
        if weight is not None:  # w·min(ρA, clip(ρ)A) = min(ρ·wA, clip(ρ)·wA) for w >= 0: the truncated IS weight
            data["advantage"] = data["advantage"] * weight.unsqueeze(-1)
        t1 = time.perf_counter()

        check_finite({"reward": data["reward"], "advantage": data["advantage"]}, self.iteration_done + 1, "the update")
        # -- PPO update: epochs × minibatches of whole sequences
        stats = self._update(data, beta)
        t2 = time.perf_counter()

        # -- KL control and diagnostics
        kl_per_seq = log_ratio.sum(1).mean().item()
        self.kl_ctl.update(kl_per_seq, data.batch_size[0])
        self.iteration_done += 1
        tokens = int(data["mask"].sum())
        self.env_steps += tokens
        self.episodes_done += data.batch_size[0]
        return {
            "iteration": self.iteration_done,
            "episodes": self.episodes_done,
            "env_steps": self.env_steps,
            **_episode_means(episodes, data["mask"]),
            "kl": kl_per_seq,
            "kl_coef": beta,
            **advantage_stats,
            **mismatch,
            **stats,
            "tokens_per_s": tokens / timing["seconds"],
            "time_rollout": timing["seconds"],
            "time_policy_sampling": timing["policy_seconds"],
            "time_advantage": t1 - t0 - timing["seconds"],
            "time_update": t2 - t1,
        }

    @torch.no_grad()
    def _pi_old(self, data) -> tuple[torch.Tensor | None, dict[str, float]]:
        """Put log π_old, teacher-forced in the update's precision, in place of the sampler's log-probs.

        Returns the truncated importance weights ``(B, T)`` (None without ``tis_cap``) and the gap's
        statistics. With ``async_rollout`` π_old *is* the policy that sampled (one step behind): its
        log-probs stay, no weights apply, and the gap reported says how far it lags.
        """
        sampled = data["sample_log_prob"]
        old = self._old_logprobs(data)
        stats = sampler_mismatch(old, sampled, data["mask"], self.cfg.tis_cap)
        weight = stats.pop("tis_weight")
        if self.cfg.async_rollout:
            return None, {k: v for k, v in stats.items() if k.startswith("logprob_mismatch")}
        data["sample_log_prob"] = old
        return (weight if self.cfg.tis_cap is not None else None), stats

    def _collect(self, num_episodes: int | None, seed: int | None, timing: dict[str, float]):
        """The rollout's complete episodes, collected on rank 0 (:mod:`.sources`) and handed to every rank."""
        episodes = None
        if distributed.is_main():
            if self.merged is not None:
                self.merged.refresh()  # the adapters as the last update (or a resumed checkpoint) left them
            draw = partial(self.estimator.starts, self.envs)  # the learner's slots draw every prompt (and game)
            episodes = self.rollouts.collect(
                self.policy, self.sampler, self.last_beta, num_episodes, seed, draw, timing
            )
            self.sampler.release()  # its KV cache is not needed through the update: freed, not held
        episodes, shared = distributed.broadcast_object((episodes, dict(timing)))
        timing.update(shared)
        return episodes

    @torch.no_grad()
    def _old_logprobs(self, data) -> torch.Tensor:
        """log π_old(a_t|s_t) ``(B, T)`` by teacher forcing in minibatches of the update's size, fp32 log-softmax
        over the policy's tokens only (:class:`.models.TokenLogProbs`)."""
        out = []
        batch = data.batch_size[0]
        minibatches = torch.tensor_split(torch.arange(batch, device=self.device), min(self.cfg.num_minibatches, batch))
        with self.autocast():  # one region: the weights do not change here, so autocast casts them to bf16 once
            for rows in minibatches:
                mb = data[rows]
                logp, _, _ = self.actor_logprobs(
                    mb["sequence"], mb["sequence_mask"], mb["mask"], mb.get("kept", None), with_entropy=False
                )  # (b, T)
                out.append(logp)
        self._last_logprobs.clear()
        return torch.cat(out) * data["mask"]

    def _kl_loss(self, mb, beta: float) -> torch.Tensor:
        """β·mean_t k(log π_θ, log π_ref) over valid tokens, with its gradient (``k2_loss``/``k3_loss``)."""
        logp = self._last_logprobs[-1][0]  # (b, T), differentiable
        per_token = kl_penalty(logp, mb["ref_logprob"], self.cfg.kl_penalty.removesuffix("_loss"))
        return beta * masked_mean(per_token, mb["mask"])

    def _update(self, data, beta: float) -> dict[str, float]:
        """Epochs × minibatches of whole sequences; stops after an epoch whose mean approx_kl passes early_stop_kl."""
        cfg = self.cfg
        sums: dict[str, float] = {}
        n_updates = epochs_run = 0
        lr = self._set_learning_rates()
        for model in (self.policy, self.critic):  # dropout stays off during PPO (N+ implementation details)
            set_update_mode(model, cfg.gradient_checkpointing)
        gen = torch.Generator().manual_seed(cfg.seed * 100003 + self.iteration_done)
        batch = data.batch_size[0]
        for _ in range(cfg.ppo_epochs):
            epochs_run += 1
            order = torch.randperm(batch, generator=gen)
            epoch_kl = []
            for rows in torch.tensor_split(order, min(cfg.num_minibatches, batch)):
                mb = trim_columns(data[rows.to(self.device)], self.envs.unwrapped.max_prompt_tokens)
                diag = self._minibatch_step(mb, beta)
                n_updates += 1
                epoch_kl.append(diag["approx_kl"])
                for key, value in diag.items():
                    sums[key] = sums.get(key, 0.0) + value
            if cfg.early_stop_kl is not None and sum(epoch_kl) / len(epoch_kl) > cfg.early_stop_kl:
                break  # CleanRL's target_kl: the policy moved far enough from π_old on this rollout
        self._last_logprobs.clear()
        return {**{k: v / n_updates for k, v in sums.items()}, "ppo_epochs_run": epochs_run, "learning_rate": lr}

    def _minibatch_step(self, mb, beta: float) -> dict[str, float]:
        """One optimizer step on a minibatch; returns its diagnostics over valid tokens.

        Under torchrun each rank computes on its share of the rows (:mod:`.distributed`): its loss is
        scaled so that DDP's average of the ranks' gradients is the gradient of the whole minibatch.
        """
        cfg = self.cfg
        mb, weight = self._rank_share(mb)
        self._last_logprobs.clear()
        with self.autocast():
            out = self.loss(mb)
        total = out["loss_objective"] + out.get("loss_critic", 0.0)
        if cfg.kl_penalty != "k1_reward":
            out["loss_kl"] = self._kl_loss(mb, beta)
            total = total + out["loss_kl"]
        self.optimizer.zero_grad(set_to_none=True)
        (total * weight * distributed.world()[1]).backward()  # token-masked means: weight x W, 1 in one process
        clip = torch.nn.utils.clip_grad_norm_
        grad_norms = {"policy gradient norm": clip(self.policy.parameters(), cfg.max_grad_norm)}
        if self.critic is not None:
            grad_norms["critic gradient norm"] = clip(self.critic.parameters(), cfg.max_grad_norm)
        # checked after the all-reduce (every rank refuses alike), before the step: the weights stay as they were
        losses = {name: out[key] for key, name in LOSS_TERMS.items() if key in out.keys()}
        check_finite({**losses, **grad_norms}, self.iteration_done + 1, "the update")
        self.optimizer.step()
        # ClipPPOLoss's own entropy/kl_approx/clip_fraction average over padding too
        logp, entropy, _ = self._last_logprobs[-1]
        diag = ppo_diagnostics(logp, entropy, mb["sample_log_prob"], mb["mask"], cfg.clip_epsilon)
        diag |= {name: loss.item() for name, loss in losses.items()}
        return distributed.mean_over_ranks(diag, weight)

    def _rank_share(self, mb):
        """This rank's rows of the minibatch and their share of its valid tokens (all of it in one process)."""
        rows, world_size = distributed.rank_share(mb.batch_size[0])
        if world_size == 1:
            return mb, 1.0
        share = mb[rows]
        return share, float(share["mask"].sum()) / float(mb["mask"].sum())

    def _set_learning_rates(self) -> float:
        """Put this iteration's rates on the schedule into the optimizer; returns the policy's."""
        factor = self.lr_factor(self.iteration_done) if self.lr_factor is not None else 1.0
        for group, lr in zip(self.optimizer.param_groups, (self.cfg.learning_rate, self.cfg.critic_learning_rate)):
            group["lr"] = lr * factor
        return self.cfg.learning_rate * factor

    def close(self) -> None:
        """Close the env, end the Ray workers (and the local Ray cluster the run started), drop the loss.

        Why the loss: under torchrun it calls the models through DDP, whose C++ Reducer holds the process
        group. Freed after :func:`.distributed.leave` destroyed the group, the Reducer drops the group's
        last reference with the GIL held and joins gloo's threads, while one of them waits for the GIL to
        free the last collective's tensors: the rank hung with its training done (2 torchrun runs in 57
        under load). Dropped here, before the group is destroyed, the last reference is Python's, whose
        release lets the GIL go. A closed trainer cannot update.
        """
        if self.rollouts is not None:
            self.rollouts.close()
            self.rollouts = None
        self.envs.close()
        self.loss = self.actor_logprobs = None

    # ------------------------------------------------------------------ samples and evaluation
    def samples(self) -> list[dict[str, Any]]:
        """The first ``num_samples`` episodes of the last rollout: prompt, response, scores (a conversation's with
        its partner's rewards, as the ``score`` metric) and KL to π_ref; a conversation's ``transcript`` too."""
        ep = self.last_episodes
        k = min(self.cfg.num_samples, ep.batch_size[0])
        kl = sequence_kl(ep)  # (B,)
        score = episode_score(ep)
        rows = [{"iteration": self.iteration_done, "prompt": ep["prompt"][i], "response": ep["response"][i],
                 "rm_score": float(ep["rm_score"][i]), "score": float(score[i]),
                 "gold_score": float(ep["gold_score"][i]), "kl": float(kl[i])} for i in range(k)]  # fmt: skip
        if "transcript" in ep.keys():
            for i, row in enumerate(rows):
                row["transcript"] = ep["transcript"][i]
        return rows

    def evaluate(self) -> dict[str, float]:
        """The current policy on ``eval_episodes`` of the env's held-out prompts at the last rollout's β (``eval_*``).

        Sampling uses its own generator and env: the training run's RNG streams are untouched.
        """
        from ..evaluate import evaluate

        cfg = self.cfg
        env_kwargs = {**cfg.env_kwargs(), **self.env_overrides, "kl_coef": self.last_beta}
        env_kwargs.pop("prompts", None)  # held-out prompts, not the train prompts
        if cfg.held_out_prompts() is not None:
            env_kwargs["prompts"] = cfg.held_out_prompts()

        def factory(envs):
            return LMSampler.for_env(self.policy, envs, temperature=cfg.temperature, top_k=cfg.top_k,
                                     top_p=cfg.top_p, seed=cfg.seed, decoder=cfg.decoder)  # fmt: skip

        result = evaluate(policy_factory=factory, episodes=cfg.eval_episodes, env_id=cfg.env_id, seed=cfg.seed,
                          num_envs=min(cfg.num_envs, cfg.eval_episodes), device=str(self.device),
                          autocast=self.autocast, **env_kwargs)  # fmt: skip
        return {f"eval_{k}": result[k][0] for k in ("score", "rm_score", "gold_score", "kl", "objective")}

    # ------------------------------------------------------------------ checkpoints
    def save(self, out: Path) -> None:
        """``out/checkpoint`` (everything to resume) and plain HF folders ``out/policy``, ``out/value`` (PPO only).

        Each folder is swapped in atomically (see :func:`textgym.files.save_folder_atomically`).
        The HF folders hard-link the checkpoint's weight files: the weights are stored once.
        """
        check_finite_weights(self.trained(), self.iteration_done)  # a NaN weight never replaces a good checkpoint
        save_folder_atomically(out / "checkpoint", self._write_checkpoint)
        self.export(out)

    def export(self, out: Path) -> None:
        """``out/policy`` and ``out/value`` from ``out/checkpoint`` (its weight files hard-linked) and the run info."""
        tok, ckpt = self.envs.unwrapped.tokenizer, out / "checkpoint"
        for folder, name, info in (("policy", "policy", self.run_info()), ("value", "critic", None)):
            if name in self.trained():  # GRPO and RLOO have no critic
                save_folder_atomically(out / folder, partial(checkpoint.write_export, ckpt / name, tokenizer=tok,
                                                             run_info=info))  # fmt: skip

    def trained(self) -> dict[str, torch.nn.Module]:
        """The trained models by checkpoint folder name (no critic for GRPO and RLOO)."""
        return {name: m for name, m in (("policy", self.policy), ("critic", self.critic)) if m is not None}

    def _write_checkpoint(self, folder: Path) -> None:
        rng_json, rng_tensors = checkpoint.rng_states()
        tensors = {"optimizer": self.optimizer.state_dict(), "sampler_rng": self.sampler.generator.get_state(),
                   **rng_tensors}  # fmt: skip
        source_json, source_tensors = self.rollouts.state() if self.rollouts is not None else ({}, {})
        state = {
            "iteration": self.iteration_done,
            "env_steps": self.env_steps,
            "episodes": self.episodes_done,
            "kl_controller": self.kl_ctl.state_dict(),
            **rng_json,
            "env_rng": self.envs.unwrapped.rng_state(),
            "config": self.cfg.to_dict(),
            "last_beta": self.last_beta,  # the β policy/textgym_run.json names: re-exported on resume from here
            "normalize_reward": reward_scale(self.env_overrides.get("normalize_reward")),  # a resume pays it too
        }
        checkpoint.write_checkpoint(folder, self.trained(), {**tensors, **source_tensors}, {**state, **source_json})

    def run_info(self) -> dict[str, Any]:
        """What evaluating the saved policy needs to measure the objective it was trained on."""
        cfg = self.cfg
        info = {**cfg.env_settings().run_info(), "kl_coef": self.last_beta, "temperature": cfg.temperature,
                "kl_penalty": cfg.kl_penalty}  # fmt: skip
        info |= {k: getattr(cfg, k) for k in ("top_k", "top_p") if getattr(cfg, k) is not None}
        if (norm := self.env_overrides.get("normalize_reward")) is not None:
            info["normalize_reward"] = reward_scale(norm)  # the scale the run paid: eval standardises alike
        return info

    def load(self, ckpt: Path) -> None:
        """Continue from ``ckpt``; this trainer's learning rates win over the saved ones (``RESUME_APPLIED``)."""
        state, tensors = checkpoint.read_checkpoint(ckpt, self.trained())
        self.optimizer.load_state_dict(tensors["optimizer"])
        for group, lr in zip(self.optimizer.param_groups, (self.cfg.learning_rate, self.cfg.critic_learning_rate)):
            group["lr"] = lr
        self.kl_ctl.load_state_dict(state["kl_controller"])
        checkpoint.set_rng_states(state, tensors)
        self.sampler.generator.set_state(tensors["sampler_rng"])
        self.envs.unwrapped.set_rng_state(state["env_rng"])
        self.iteration_done = state["iteration"]
        self.last_beta = state.get("last_beta", self.kl_ctl.value)
        self.env_steps, self.episodes_done = state["env_steps"], state["episodes"]
        if self.rollouts is not None:
            self.rollouts.load_state(ckpt, state, tensors)


def reward_scale(norm: Any) -> list[float] | bool | None:
    """``normalize_reward`` as a run records it: ``[mean, std]`` of the scale it paid, False for raw scores."""
    return list(map(float, norm)) if isinstance(norm, tuple | list) else norm


def _episode_means(episodes, mask: torch.Tensor) -> dict[str, float]:
    """The rollout's mean RM score, score (standardised, plus a partner's turn rewards), gold score and response
    length."""
    return {
        "rm_score": float(episodes["rm_score"].mean()),
        "score": float(episode_score(episodes).mean()),
        "gold_score": float(np.nanmean(episodes["gold_score"].numpy())),
        "response_length": float(mask.float().sum(1).mean()),
    }


def lr_schedule(cfg: PPOConfig):
    """Iteration -> learning-rate multiplier: transformers' schedule, stepped once per iteration.

    As in transformers, warmup rises linearly from 0 (the first warmup iteration updates with rate 0),
    then ``linear`` and ``cosine`` decay towards 0 at ``num_iterations``; ``constant`` stays at 1.
    """
    from transformers import get_scheduler

    name = "constant_with_warmup" if cfg.lr_schedule == "constant" and cfg.warmup_iterations else cfg.lr_schedule
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # its own optimizer: ours stays untouched
    schedule = get_scheduler(name, probe, num_warmup_steps=cfg.warmup_iterations, num_training_steps=cfg.num_iterations)
    return schedule.lr_lambdas[0]
