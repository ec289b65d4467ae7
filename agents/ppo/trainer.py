"""PPO for RLHF on TextRLHF-v0, read top to bottom: setup, then rollout → advantages → update → log.

from textgym.agents.ppo import PPOConfig, train
metrics = train(PPOConfig(total_episodes=512, out="runs/x"))
"""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

import textgym  # noqa: F401  (registers TextRLHF-v0)
from textgym.episodes import collect_episodes
from textgym.functional import gather_logprobs, kl_penalty, masked_mean
from textgym.models import native_bf16, resolve_device
from textgym.policies import LMSampler
from textgym.threads import default_threads, machine_threads, use_threads
from textgym.utils import (
    check_writable_folder,
    link_files,
    lock_folder,
    recover_folder,
    save_folder_atomically,
    short_repr,
    write_text_atomically,
)

from ..evaluate import RUN_INFO
from . import distributed
from .calibration import run_norm
from .config import RESUME_APPLIED, RESUME_FREE, PPOConfig, field_defaults
from .guards import Stopped, check_finite, check_finite_weights, check_memory, stop_on_sigterm
from .kl import make_kl_controller
from .models import (
    TokenLogits,
    TokenValues,
    make_actor,
    make_critic,
    make_lora_actor,
    make_loss,
    ppo_diagnostics,
    trainable,
)
from .rollout import (
    compute_advantages,
    explained_variance,
    group_advantages,
    per_token_rewards,
    sampler_mismatch,
    sequence_batch,
    trim_columns,
)

__all__ = ["Trainer", "train"]


@dataclass
class Trainer:
    """Everything a run holds; built by :meth:`Trainer.create`, stepped by :meth:`iteration`."""

    cfg: PPOConfig
    envs: Any
    policy: torch.nn.Module
    critic: torch.nn.Module | None  # None for the critic-free GRPO and RLOO
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
    lr_factor: Any = None  # iteration -> learning-rate multiplier (warmup, then the schedule's decay)
    env_overrides: dict = field(default_factory=dict)  # gym.make arguments beyond the config's (the benchmark's)
    last_episodes: Any = None  # the last rollout's episodes (for the logged samples)
    pool: Any = None  # the Ray rollout workers (num_workers > 0; rank 0 only)
    pending: Any = None  # async_rollout: the next iteration's rollout, collecting while this one updates

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
        lora = (cfg.lora_rank, cfg.lora_alpha) if cfg.lora_rank else None
        policy = make_policy(cfg, base)
        critic = make_critic(base.reward_model, policy, lora) if cfg.algo == "ppo" else None  # GRPO/RLOO: none
        # under torchrun the loss calls the models through DDP (gradients all-reduced); saved are the bare ones
        truncated = cfg.top_k is not None or cfg.top_p is not None  # the update reads the sampler's kept sets
        loss, actor_logits = make_loss(distributed.wrap(policy, device), distributed.wrap(critic, device),
                                       base.max_prompt_tokens, cfg.temperature, cfg.clip_epsilon, cfg.clip_value,
                                       cfg.critic_coef, truncated)  # fmt: skip
        groups = [{"params": trainable(policy), "lr": cfg.learning_rate}]
        if critic is not None:
            groups.append({"params": trainable(critic), "lr": cfg.critic_learning_rate})
        # fused: one kernel over all parameters instead of a foreach loop: 23 -> 4 ms per step here (CPU and CUDA)
        optimizer = torch.optim.AdamW(groups, eps=1e-5, fused=device.type in ("cpu", "cuda"))
        generator = torch.Generator(device=device).manual_seed(cfg.seed)
        sampler = LMSampler.for_env(policy, envs, temperature=cfg.temperature, generator=generator, top_k=cfg.top_k,
                                    top_p=cfg.top_p)  # fmt: skip
        kl_ctl = make_kl_controller(cfg.kl_coef, cfg.target_kl, cfg.kl_horizon)
        trainer = cls(cfg, envs, policy, critic, loss, actor_logits, optimizer, kl_ctl, sampler, device,
                      last_beta=kl_ctl.value, lr_factor=lr_schedule(cfg),
                      env_overrides=dict(env_overrides or {}))  # fmt: skip
        actor_logits.register_forward_hook(lambda module, inputs, output: trainer._last_logits.append(output))
        if cfg.num_workers and distributed.is_main():  # rank 0 collects every rollout
            from .ray_rollout import RolloutPool

            trainer.pool = RolloutPool(cfg, trainer.env_overrides, device, bf16=trainer.bf16)
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
        if seed is not None and cfg.algo != "ppo":  # seed the slots' prompt RNGs before groups draw from them
            self.envs.reset(seed=seed)
            seed = None
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
        advantage_stats = self._advantages(data, episodes, log_ratio, in_reward)
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
        """The rollout's complete episodes, collected on rank 0 and handed to every rank of a torchrun learner.

        In this process (``collect_episodes`` on its env and policy) or on the Ray workers (``num_workers``),
        either waiting for them or (``async_rollout``) taking the rollout they collected during the last update.
        """
        episodes = None
        if distributed.is_main():
            if self.pool is None:
                episodes = collect_episodes(self.envs, self.sampler, num_episodes=num_episodes, seed=seed,
                                            autocast=self.autocast, prompts=self._group_prompts(num_episodes),
                                            timing=timing)  # fmt: skip
            elif self.cfg.async_rollout:
                episodes = self._collect_async(num_episodes, seed, timing)
            else:
                rollout = self._launch(num_episodes, seed)
                episodes = self.pool.gather(rollout)
                timing.update(rollout.timing)
        episodes, shared = distributed.broadcast_object((episodes, dict(timing)))
        timing.update(shared)
        return episodes

    def _launch(self, num_episodes: int | None, seed: int | None):
        """Start the Ray workers on a rollout with the current weights and β (GRPO/RLOO: the learner's prompts)."""
        return self.pool.launch(self.policy, self.last_beta, num_episodes, self._group_prompts(num_episodes), seed)

    def _collect_async(self, num_episodes: int | None, seed: int | None, timing: dict[str, float]):
        """One-step asynchronous rollout: the episodes the workers collected with the last iteration's weights;
        the next iteration's rollout starts now, with this iteration's weights, and runs during the update.

        Raises:
            ValueError: ``num_episodes`` is not the whole batch (the next rollout is sized before it is asked for).
        """
        if num_episodes not in (None, self.cfg.num_envs):
            raise ValueError(f"num_episodes={num_episodes} with async_rollout=True: the rollout collected ahead is "
                             f"num_envs={self.cfg.num_envs} episodes; pass None or turn async_rollout off")  # fmt: skip
        start = time.perf_counter()
        rollout = self.pending if self.pending is not None else self._launch(None, seed)
        self.pending = None
        episodes = self.pool.gather(rollout)  # waits only for what the last update did not cover
        # the env paid β_then·log π_ref per token; the reward contract r_t = β·log π_ref (+ score) at this β:
        episodes["env_reward"] = episodes["env_reward"] + (self.last_beta - rollout.beta) * episodes["ref_logprob"]
        if self.iteration_done + 1 < self.cfg.num_iterations:
            self.pending = self._launch(None, None)
        timing.update(seconds=time.perf_counter() - start, policy_seconds=rollout.timing["policy_seconds"])
        return episodes

    def _group_prompts(self, num_episodes: int | None) -> list[str] | None:
        """GRPO/RLOO: one prompt per group of G consecutive slots (drawn with the group's first slot RNG)."""
        if self.cfg.algo == "ppo":
            return None  # every slot draws its own
        n, g = num_episodes or self.cfg.num_envs, self.cfg.group_size
        if n % g:
            raise ValueError(f"num_episodes={n} must be a multiple of group_size={g} for algo={self.cfg.algo!r}")
        return [p for p in self.envs.unwrapped.draw_prompts(range(0, n, g)) for _ in range(g)]

    @torch.no_grad()
    def _advantages(self, data, episodes, log_ratio: torch.Tensor, kl_coef: float) -> dict[str, float]:
        """Write ``advantage`` (B, T, 1) into ``data``: GAE over the critic (PPO) or the group baseline.

        The groups take each episode's exact score from the env (not the per-token rewards minus
        β·log π_ref, whose float32 rounding would be noise that GRPO's 1/σ blows up) and its k1 KL
        return Σ_t log(π_old/π_ref), weighted by ``kl_coef`` (β, or 0 for a loss-side KL).
        """
        cfg, mask = self.cfg, data["mask"]
        if cfg.algo == "ppo":
            with self.autocast():
                compute_advantages(data, TokenValues(self.critic, self.envs.unwrapped.max_prompt_tokens), cfg.gamma,
                                   cfg.lmbda, cfg.whiten_rewards)  # fmt: skip
            return {"explained_variance": explained_variance(data["state_value"][..., 0], data["value_target"][..., 0],
                                                             mask)}  # fmt: skip
        scores = (episodes["score_reward"] + episodes["eos_penalty"]).to(self.device, torch.float32)  # (B,)
        advantage = group_advantages(scores, log_ratio.sum(1), cfg.group_size, cfg.algo, kl_coef,
                                     cfg.grpo_scale)  # (B,): every token of an episode  # fmt: skip
        data["advantage"] = (advantage[:, None] * mask).unsqueeze(-1)  # (B, T, 1)
        return {"group_score_std": float(scores.view(-1, cfg.group_size).std(1).mean())}

    @torch.no_grad()
    def _old_logprobs(self, data) -> torch.Tensor:
        """log π_old(a_t|s_t) ``(B, T)`` by teacher forcing in minibatches of the update's size, fp32 log-softmax."""
        out = []
        batch = data.batch_size[0]
        for rows in torch.tensor_split(torch.arange(batch, device=self.device), min(self.cfg.num_minibatches, batch)):
            mb = data[rows]
            with self.autocast():
                logits = self.actor_logits(mb["sequence"], mb["sequence_mask"], mb.get("kept", None))  # (b, T, V)
            out.append(gather_logprobs(logits, mb["action"]))
        self._last_logits.clear()
        return torch.cat(out) * data["mask"]

    def _kl_loss(self, mb, beta: float) -> torch.Tensor:
        """β·mean_t k(log π_θ, log π_ref) over valid tokens, with its gradient (``k2_loss``/``k3_loss``)."""
        logp = gather_logprobs(self._last_logits[-1], mb["action"])  # (b, T), differentiable
        per_token = kl_penalty(logp, mb["ref_logprob"], self.cfg.kl_penalty.removesuffix("_loss"))
        return beta * masked_mean(per_token, mb["mask"])

    def _update(self, data, beta: float) -> dict[str, float]:
        """Epochs × minibatches of whole sequences; stops after an epoch whose mean approx_kl passes early_stop_kl."""
        cfg = self.cfg
        sums: dict[str, float] = {}
        n_updates = epochs_run = 0
        lr = self._set_learning_rates()
        self.policy.train(False)  # dropout stays off during PPO (N+ implementation details)
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
        self._last_logits.clear()
        return {**{k: v / n_updates for k, v in sums.items()}, "ppo_epochs_run": epochs_run, "learning_rate": lr}

    def _minibatch_step(self, mb, beta: float) -> dict[str, float]:
        """One optimizer step on a minibatch; returns its diagnostics over valid tokens.

        Under torchrun each rank computes on its share of the rows (:mod:`.distributed`): its loss is
        scaled so that DDP's average of the ranks' gradients is the gradient of the whole minibatch.
        """
        cfg = self.cfg
        mb, weight = self._rank_share(mb)
        self._last_logits.clear()
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
        losses = {name: out[key] for name, key in (("policy loss", "loss_objective"), ("value loss", "loss_critic"),
                                                   ("KL loss", "loss_kl")) if key in out.keys()}  # fmt: skip
        check_finite({**losses, **grad_norms}, self.iteration_done + 1, "the update")
        self.optimizer.step()
        # ClipPPOLoss's own entropy/kl_approx/clip_fraction average over padding too
        diag = ppo_diagnostics(self._last_logits[-1], mb["action"], mb["sample_log_prob"], mb["mask"],
                               cfg.clip_epsilon)  # fmt: skip
        diag["policy_loss"] = out["loss_objective"].item()
        if "loss_critic" in out.keys():
            diag["value_loss"] = out["loss_critic"].item()
        if "loss_kl" in out:
            diag["kl_loss"] = out["loss_kl"].item()
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
        """Close the env and end the Ray workers (and the local Ray cluster the run started)."""
        self.pending = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.envs.close()

    # ------------------------------------------------------------------ samples and evaluation
    def samples(self) -> list[dict[str, Any]]:
        """The first ``num_samples`` episodes of the last rollout: prompt, response, scores and KL to π_ref."""
        ep = self.last_episodes
        k = min(self.cfg.num_samples, ep.batch_size[0])
        kl = ((ep["sample_log_prob"] - ep["ref_logprob"]) * ep["mask"]).sum(1)  # (B,)
        return [{"iteration": self.iteration_done, "prompt": ep["prompt"][i], "response": ep["response"][i],
                 "rm_score": float(ep["rm_score"][i]), "score": float(ep["score_reward"][i]),
                 "gold_score": float(ep["gold_score"][i]), "kl": float(kl[i])} for i in range(k)]  # fmt: skip

    def evaluate(self) -> dict[str, float]:
        """The current policy on ``eval_episodes`` of the env's held-out prompts at the last rollout's β (``eval_*``).

        Sampling uses its own generator and env: the training run's RNG streams are untouched.
        """
        from ..evaluate import evaluate

        cfg = self.cfg
        env_kwargs = {**cfg.env_kwargs(), **self.env_overrides, "kl_coef": self.last_beta}
        env_kwargs.pop("prompts", None)  # held-out prompts, not the train prompts
        if cfg.eval_prompts is not None:
            env_kwargs["prompts"] = cfg.eval_prompts

        def factory(envs):
            return LMSampler.for_env(self.policy, envs, temperature=cfg.temperature, top_k=cfg.top_k,
                                     top_p=cfg.top_p, seed=cfg.seed)  # fmt: skip

        result = evaluate(policy_factory=factory, episodes=cfg.eval_episodes, env_id=cfg.env_id, seed=cfg.seed,
                          num_envs=min(cfg.num_envs, cfg.eval_episodes), device=str(self.device),
                          **env_kwargs)  # fmt: skip
        return {f"eval_{k}": result[k][0] for k in ("score", "rm_score", "gold_score", "kl", "objective")}

    # ------------------------------------------------------------------ checkpoints
    def save(self, out: Path) -> None:
        """``out/checkpoint`` (everything to resume) and plain HF folders ``out/policy``, ``out/value`` (PPO only).

        Each folder is swapped in atomically (see :func:`textgym.utils.save_folder_atomically`).
        The HF folders hard-link the checkpoint's weight files: the weights are stored once.
        """
        check_finite_weights(self._trained(), self.iteration_done)  # a NaN weight never replaces a good checkpoint
        save_folder_atomically(out / "checkpoint", self._write_checkpoint)
        self.export(out)

    def export(self, out: Path) -> None:
        """``out/policy`` and ``out/value`` from ``out/checkpoint`` (its weight files hard-linked) and the run info."""
        tok = self.envs.unwrapped.tokenizer

        def hf_folder(name: str, info: bool):
            def write(folder: Path) -> None:
                link_files(out / "checkpoint" / name, folder)
                tok.save_pretrained(folder)
                if info:
                    (folder / RUN_INFO).write_text(json.dumps(self.run_info()))

            return write

        save_folder_atomically(out / "policy", hf_folder("policy", info=True))
        if self.critic is not None:  # GRPO and RLOO have none
            save_folder_atomically(out / "value", hf_folder("critic", info=False))

    def _trained(self) -> dict[str, torch.nn.Module]:
        """The trained models by checkpoint folder name (no critic for GRPO and RLOO)."""
        return {name: m for name, m in (("policy", self.policy), ("critic", self.critic)) if m is not None}

    def _write_checkpoint(self, folder: Path) -> None:
        """Weights as HF folders; tensors in ``state.pt`` (loadable with ``weights_only=True``); the rest as JSON."""
        for name, model in self._trained().items():
            model.save_pretrained(folder / name)
        tensors = {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                   "sampler_rng": self.sampler.generator.get_state()}  # fmt: skip
        workers_json, workers_tensors = self._workers_state()
        torch.save({**tensors, **workers_tensors}, folder / STATE_TENSORS)
        (folder / STATE_JSON).write_text(json.dumps({**self._state(), **workers_json}, indent=1) + "\n")

    def _workers_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """With Ray workers: the RNG states their next shares start from (JSON: the slots'; tensors: the samplers');
        with ``async_rollout`` also the rollout already collected for the next iteration, and its β."""
        if self.pool is None:
            return {}, {}
        from .ray_rollout import episodes_to_state

        tensors = {}
        if self.pending is not None:  # gathered first: the workers' RNG states are those after it
            tensors["pending_episodes"] = episodes_to_state(self.pool.gather(self.pending))
        env_states, sampler_states = self.pool.state()
        tensors["worker_sampler_rng"] = sampler_states
        extra = {"pending_beta": self.pending.beta} if self.pending is not None else {}
        return {"worker_env_rng": env_states, **extra}, tensors

    def _state(self) -> dict[str, Any]:
        """Counters, KL controller, config and the RNG states as plain JSON (numpy's key array as a list)."""
        np_rng, py_rng = np.random.get_state(), random.getstate()
        return {
            "iteration": self.iteration_done,
            "env_steps": self.env_steps,
            "episodes": self.episodes_done,
            "kl_controller": self.kl_ctl.state_dict(),
            "numpy_rng": [np_rng[0], np_rng[1].tolist(), int(np_rng[2]), int(np_rng[3]), float(np_rng[4])],
            "python_rng": [py_rng[0], list(py_rng[1]), py_rng[2]],
            "env_rng": self.envs.unwrapped.rng_state(),
            "config": self.cfg.to_dict(),
            "last_beta": self.last_beta,  # the β policy/textgym_run.json names: re-exported on resume from here
        }

    def run_info(self) -> dict[str, Any]:
        """What evaluating the saved policy needs to measure the objective it was trained on."""
        cfg = self.cfg
        info = {"env_id": cfg.env_id, "kl_coef": self.last_beta, "max_new_tokens": cfg.max_new_tokens,
                "temperature": cfg.temperature,
                "missing_eos_penalty": cfg.missing_eos_penalty, "kl_penalty": cfg.kl_penalty}  # fmt: skip
        settings = ("model", "reward_model", "top_k", "top_p", "eval_prompts", "normalize_reward")
        info |= {k: getattr(cfg, k) for k in settings if getattr(cfg, k) is not None}
        if isinstance(norm := self.env_overrides.get("normalize_reward"), tuple | list):
            info["normalize_reward"] = list(norm)  # the run's own calibration: eval standardises alike
        return info | ({"chat_template": True} if cfg.chat_template else {})

    def load(self, ckpt: Path) -> None:
        """Continue from ``ckpt``; this trainer's learning rates win over the saved ones (``RESUME_APPLIED``).

        Every file is read and the weights checked key by key before anything changes; nothing is
        unpickled but tensors and plain containers.
        """
        state = read_state(ckpt)
        tensors = _load_tensors(ckpt / STATE_TENSORS)
        weights = {
            name: _read_weights(model, ckpt / name / _weights_file(model)) for name, model in self._trained().items()
        }
        for name, model in self._trained().items():
            _load_weights(model, weights[name])
        self.optimizer.load_state_dict(tensors["optimizer"])
        for group, lr in zip(self.optimizer.param_groups, (self.cfg.learning_rate, self.cfg.critic_learning_rate)):
            group["lr"] = lr
        self.kl_ctl.load_state_dict(state["kl_controller"])
        _set_rng_states(state, tensors)
        self.sampler.generator.set_state(tensors["sampler_rng"])
        self.envs.unwrapped.set_rng_state(state["env_rng"])
        self.iteration_done = state["iteration"]
        self.last_beta = state.get("last_beta", self.kl_ctl.value)
        self.env_steps, self.episodes_done = state["env_steps"], state["episodes"]
        if self.pool is not None:
            self._load_workers_state(ckpt, state, tensors)

    def _load_workers_state(self, ckpt: Path, state: dict[str, Any], tensors: dict[str, Any]) -> None:
        """The Ray workers' RNG states (and the rollout collected ahead) from ``ckpt``; see :meth:`_workers_state`."""
        from .ray_rollout import Rollout, episodes_from_state

        if "worker_env_rng" not in state or "worker_sampler_rng" not in tensors:
            raise ValueError(f"checkpoint {ckpt} holds no rollout-worker RNG states (saved with num_workers=0); "
                             f"this run has num_workers={self.cfg.num_workers}")  # fmt: skip
        self.pool.load_state(state["worker_env_rng"], tensors["worker_sampler_rng"])
        self.pending = None
        if "pending_episodes" in tensors:
            episodes = episodes_from_state(tensors["pending_episodes"])
            self.pending = Rollout([], None, state["pending_beta"], 0.0, episodes, {"policy_seconds": 0.0})


def _episode_means(episodes, mask: torch.Tensor) -> dict[str, float]:
    """The rollout's mean RM score, score (standardised), gold score and response length."""
    return {
        "rm_score": float(episodes["rm_score"].mean()),
        "score": float(episodes["score_reward"].mean()),
        "gold_score": float(np.nanmean(episodes["gold_score"].numpy())),
        "response_length": float(mask.float().sum(1).mean()),
    }


def make_policy(cfg: PPOConfig, base) -> torch.nn.Module:
    """The trainable policy over the env ``base``'s π_ref: a full copy, or LoRA adapters on π_ref itself."""
    lora = (cfg.lora_rank, cfg.lora_alpha) if cfg.lora_rank else None
    return make_lora_actor(base.model, *lora, base) if lora else make_actor(base.model)


def make_envs(cfg: PPOConfig, num_envs: int, device: torch.device, env_overrides: dict[str, Any] | None = None):
    """The native vector env of ``cfg`` with ``num_envs`` slots (the learner's, or a rollout worker's share)."""
    return gym.make_vec(
        cfg.env_id,
        num_envs=num_envs,
        vectorization_mode="vector_entry_point",
        autoreset_mode="disabled",  # one complete episode per slot (collect_episodes)
        device=device,
        **{**cfg.env_kwargs(), **(env_overrides or {})},
    )


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


# ---------------------------------------------------------------------- checkpoint files
STATE_JSON = "state.json"  # counters, KL controller, RNG states, config
STATE_TENSORS = "state.pt"  # optimizer state and torch RNG states: tensors only
WEIGHTS = "model.safetensors"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # a LoRA model's checkpoint: its adapters (and head) only


def _is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def _weights_file(model: torch.nn.Module) -> str:
    return ADAPTER_WEIGHTS if _is_lora(model) else WEIGHTS


def _expected_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state a checkpoint of ``model`` holds: everything, or a LoRA model's trained part as peft saves it."""
    if not _is_lora(model):
        return model.state_dict()
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def _load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    if not _is_lora(model):
        model.load_state_dict(weights, strict=True)
        return
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, weights)


_STATE_KEYS = ("iteration", "env_steps", "episodes", "kl_controller", "numpy_rng", "python_rng", "env_rng", "config")


def read_state(ckpt: Path) -> dict[str, Any]:
    """``ckpt/state.json``, with every key a resume needs.

    Raises:
        FileNotFoundError: naming the missing file (a checkpoint from before state.json cannot resume).
        ValueError: naming the file and what is wrong with it.
    """
    path = Path(ckpt) / STATE_JSON
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing: the run cannot continue from {ckpt}")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"checkpoint file {path} is not valid JSON ({err})") from err
    missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"checkpoint file {path} lacks {', '.join(missing)}")
    return state


def _load_tensors(path: Path) -> dict[str, Any]:
    """``state.pt`` unpickled with ``weights_only=True``: a crafted checkpoint cannot run code."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing: the run cannot continue from {path.parent}")
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError for forbidden objects, RuntimeError for a torn file
        raise ValueError(
            f"checkpoint file {path} cannot be loaded as tensors only (torch.load weights_only=True: "
            f"{type(err).__name__}: {err}); anything else is refused, since unpickling it could run code"
        ) from err
    missing = [
        k for k in ("optimizer", "torch_rng", "sampler_rng") if not isinstance(tensors, dict) or k not in tensors
    ]
    if missing:
        raise ValueError(f"checkpoint file {path} lacks {', '.join(missing)}")
    return tensors


def _read_weights(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The weights in ``path``, checked to fit ``model`` exactly: every key, no extra one, every shape.

    ``save_pretrained`` leaves tied weights out (``lm_head.weight`` when it is the embedding):
    that is the one expected absence, filled from the weight it is tied to so the load is strict.
    """
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    try:
        weights = load_file(path)
    except Exception as err:  # safetensors' own error type: a truncated or garbage file
        raise ValueError(f"checkpoint file {path} is truncated or corrupt ({type(err).__name__}: {err})") from err
    expected = _expected_weights(model)
    _fill_tied(model, weights)
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(weights) & set(expected) if weights[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(
            f"checkpoint file {path} does not fit this run's model: missing {missing[:4]} ({len(missing)}), "
            f"unexpected {unexpected[:4]} ({len(unexpected)}), wrong shape {wrong[:4]} ({len(wrong)})"
        )
    return weights


def _fill_tied(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Give every name of a tied group the tensor saved under one of them (``save_pretrained`` keeps one)."""
    for group in _tied_groups(model) if not _is_lora(model) else ():
        present = [k for k in group if k in weights]
        for key in group if present else ():
            weights.setdefault(key, weights[present[0]])


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names that share one parameter (tied embeddings), each group in state-dict order."""
    groups: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]


def _set_rng_states(state: dict[str, Any], tensors: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_rng"])
    kind, keys, *rest = state["numpy_rng"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))


# ---------------------------------------------------------------------- the run folder
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"  # sample completions every `samples_every` iterations
RUN_FOLDERS = ("checkpoint", "policy", "value")  # written with save_folder_atomically
EXPORTS = {"policy": "policy", "value": "critic"}  # exported HF folder -> the checkpoint folder it is made from
RUN_FILES = (METRICS, SAMPLES, "config.json", "tensorboard", *RUN_FOLDERS)  # what --overwrite removes


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``; a torn last line (a crash or a full disk mid-append) is dropped with a warning.

    Raises:
        ValueError: naming the file and line of any other bad row.
    """
    if not path.exists():
        return []
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    last = lines.pop()  # "" when the file ends with a newline, as every complete append does
    rows = [_metrics_row(path, n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    if last.strip():
        try:
            rows.append(_metrics_row(path, len(lines) + 1, last))  # a whole row that lost only its newline
        except ValueError:
            warnings.warn(f"{path}: dropped the torn last line {len(lines) + 1} ({short_repr(last, 60)})", stacklevel=2)
    return rows


def _metrics_row(path: Path, n: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except ValueError as err:
        raise ValueError(f"{path}:{n}: not a JSON metrics row ({err}): {short_repr(line, 60)}") from err
    if not isinstance(row, dict) or not isinstance(row.get("iteration"), int):
        raise ValueError(
            f"{path}:{n}: a metrics row is a JSON object with an int 'iteration', got {short_repr(line, 60)}"
        )
    return row


BEFORE_FIELDS = {"tis_cap": None}  # what a run saved before these fields existed did


def check_resume_config(saved: dict[str, Any], cfg: PPOConfig) -> None:
    """Refuse a resume that changes what defines the run; warn about the allowed changes it applies.

    A field the saved config lacks (added to ``PPOConfig`` after the run started) counts as its default,
    but for those whose default changed what a run does (``BEFORE_FIELDS``): a run saved before
    ``tis_cap`` existed trained without importance weights, so resuming it asks for ``--tis-cap none``.
    """
    saved = {**field_defaults(), **BEFORE_FIELDS, **saved}
    now = cfg.to_dict()
    if now["threads"] is None:  # not given: the run's own (train() takes it before the models load)
        now["threads"] = saved["threads"]
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k, "<unset>") != now.get(k, "<unset>"))
    refused = [k for k in changed if k not in RESUME_APPLIED + RESUME_FREE]
    if refused:
        listing = ", ".join(f"{k}: {saved.get(k, '<unset>')!r} -> {now.get(k, '<unset>')!r}" for k in refused)
        raise ValueError(
            f"resume=True for out={cfg.out!r} changes settings that define the run: {listing}; give the run's "
            f"values, another --out, or --overwrite. Only {', '.join(RESUME_APPLIED)} may change (and are applied)"
        )
    for key in (k for k in changed if k in RESUME_APPLIED):
        warnings.warn(f"resume: {key} changes from {saved[key]!r} to {now[key]!r} (applied)", stacklevel=2)


def _holds_run(out: Path) -> list[str]:
    """What in ``out`` belongs to a run worth keeping: metrics rows or saved folders."""
    found = [name for name in RUN_FOLDERS if (out / name).is_dir()]
    metrics = out / METRICS
    if metrics.is_file() and metrics.stat().st_size:
        found.append(METRICS)
    return found


def _recover(out: Path) -> None:
    """Finish or undo the saves a crash interrupted and drop incomplete temp files, each reported as a warning."""
    for name in RUN_FOLDERS:
        if note := recover_folder(out / name):
            warnings.warn(f"{out / name}: {note}", stacklevel=4)
    for name in (METRICS, "config.json"):
        (out / f".{name}.tmp").unlink(missing_ok=True)


def _open_run_folder(out: Path, cfg: PPOConfig, overwrite: bool) -> list[dict[str, Any]] | None:
    """Decide, before any model loads, how the run in ``out`` goes on; refuse whatever would lose or mix it up.

    Returns:
        The metrics rows to keep when resuming, None when starting a new run.
    """
    if cfg.resume and overwrite:
        raise ValueError(
            f"resume=True and overwrite=True for out={cfg.out!r}: continue the run or replace it, not both"
        )
    _recover(out)
    found = _holds_run(out)
    if overwrite or not found:
        return None
    if not cfg.resume:
        raise FileExistsError(
            f"out={cfg.out!r} already holds a run ({', '.join(found)}); pass --resume (resume=True) to continue "
            "it or --overwrite (train(cfg, overwrite=True)) to replace it"
        )
    if found == [METRICS]:  # stopped before its first save completed: no iteration was kept to continue from
        warnings.warn(f"{out}: no checkpoint was ever saved (the run stopped before its first save): it starts "
                      f"again from iteration 1, replacing {out / METRICS}", stacklevel=3)  # fmt: skip
        return None
    if not (out / "checkpoint").is_dir():
        raise FileNotFoundError(
            f"resume=True but out={cfg.out!r} has no checkpoint ({out / 'checkpoint'} is missing; it holds "
            f"{', '.join(found)}): the run cannot continue where it stopped; pass --overwrite to start it again"
        )
    state = read_state(out / "checkpoint")
    if cfg.threads is None:  # not given: the run's own (None in a run saved before it was recorded)
        cfg.threads = state["config"].get("threads")
    check_resume_config(state["config"], cfg)
    kept = [row for row in read_metrics(out / METRICS) if row["iteration"] <= state["iteration"]]
    if len(kept) != state["iteration"]:
        warnings.warn(f"{out / METRICS} holds {len(kept)} rows for the checkpoint's {state['iteration']} "
                      "iterations; the missing ones are not recovered", stacklevel=3)  # fmt: skip
    return kept


def _clear_run(out: Path) -> None:
    """Remove the run files ``--overwrite`` replaces (other files in ``out`` stay)."""
    for name in RUN_FILES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _log_row(reporter, bar, row: dict[str, float]) -> None:
    reporter.log_row(row)
    # the postfix first, then one refresh: a set_postfix after update() drew the last line a second time
    bar.set_postfix(score=f"{row['score']:+.2f}", gold=f"{row['gold_score']:+.2f}", kl=f"{row['kl']:.2f}",
                    refresh=False)  # fmt: skip
    bar.update()


def _log_samples(out: Path, reporter, rows: list[dict[str, Any]]) -> None:
    """Append sample completions to ``samples.jsonl`` and hand them to the reporters (a table in each)."""
    with (out / SAMPLES).open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    reporter.log_samples(rows)


def _keep_samples(out: Path, iteration: int) -> None:
    """On resume: drop the sample rows past the checkpoint's iteration (those iterations run again)."""
    path = out / SAMPLES
    if path.is_file():
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        write_text_atomically(path, "".join(line + "\n" for line in lines if _sample_iteration(line) <= iteration))


def _sample_iteration(line: str) -> int:
    """The iteration of a ``samples.jsonl`` row; a torn row counts as past every checkpoint (dropped)."""
    try:
        return int(json.loads(line)["iteration"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def _start(out: Path, cfg: PPOConfig, overwrite: bool) -> tuple[Trainer, list[dict[str, float]]]:
    """Open the run folder, build the trainer (loading the checkpoint on resume), write the kept metrics and config.

    Under torchrun rank 0 decides about the folder and writes; every rank builds its trainer and
    reads the checkpoint (one machine, or ``out`` on a file system every node sees).
    """
    main = distributed.is_main()
    check_memory(cfg)  # before any model loads: a batch the machine cannot hold is refused with the estimate
    # rank 0 decides the thread count too (the resumed run's, else the default) and every rank takes it
    history, cfg.threads = distributed.on_main(
        lambda: (_open_run_folder(out, cfg, overwrite), cfg.threads or default_threads())
    )
    if cfg.threads > machine_threads():
        warnings.warn(f"threads={cfg.threads} is more than the {machine_threads()} cores this process may use: "
                      "the run's numbers are the same, its speed lower", stacklevel=3)  # fmt: skip
    trainer = Trainer.create(cfg)
    if history is not None:
        trainer.load(out / "checkpoint")
        if main:
            _repair_exports(out, trainer)
    elif overwrite and main:
        _clear_run(out)  # only now that the new run's models have loaded
    history = history or []
    if main:
        _keep_samples(out, trainer.iteration_done)
        write_text_atomically(out / METRICS, "".join(json.dumps(r) + "\n" for r in history))
        write_text_atomically(out / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
    return trainer, history


def _repair_exports(out: Path, trainer: Trainer) -> None:
    """Re-export ``policy/`` and ``value/`` when they are not the checkpoint's (a crash during the last save).

    Why: a save swaps in the checkpoint first, then the exports; killed between the two, the run
    resumes from the new checkpoint while ``policy/`` still holds an earlier iteration's weights and β.
    """
    info = {"policy": trainer.run_info()}  # value/ holds no run info
    stale = [folder for folder, name in EXPORTS.items() if name in trainer._trained()
             and not _export_matches(out / "checkpoint" / name, out / folder, info.get(folder))]  # fmt: skip
    if stale:
        warnings.warn(f"{out}: {', '.join(stale)} do not match {out / 'checkpoint'} (a crash during its last save): "
                      "re-exported from the checkpoint", stacklevel=4)  # fmt: skip
        trainer.export(out)


def _export_matches(ckpt: Path, folder: Path, run_info: dict[str, Any] | None) -> bool:
    """Whether ``folder`` holds each file of ``ckpt`` unchanged (and, for the policy, this run info)."""
    if not folder.is_dir():
        return False
    for path in (p for p in ckpt.iterdir() if p.is_file()):
        twin = folder / path.name
        if not (twin.is_file() and (os.path.samefile(path, twin) or filecmp.cmp(path, twin, shallow=False))):
            return False
    if run_info is None:
        return True
    try:
        return json.loads((folder / RUN_INFO).read_text()) == json.loads(json.dumps(run_info))
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _run_folder(out: Path):
    """Rank 0 holds ``out``: writable, locked, SIGTERM raised as :class:`Stopped`, and a stop reported."""
    check_writable_folder(out, "out")
    with stop_on_sigterm(), lock_folder(out, "out"):
        try:
            yield
        except KeyboardInterrupt as err:
            _report_stop(out, err)
            raise


def _report_stop(out: Path, err: KeyboardInterrupt) -> None:
    """Say on stderr what the run folder holds after a SIGTERM or Ctrl-C: the checkpoint a resume continues from."""
    name = "SIGTERM" if isinstance(err, Stopped) else "SIGINT"
    _recover(out)  # a stop during a save: finish or undo its swap first
    try:
        saved = read_state(out / "checkpoint")["iteration"]
        note = (f"the checkpoint in {out / 'checkpoint'} holds iteration {saved}; --resume continues from it "
                "(the iterations after it run again)")  # fmt: skip
    except (OSError, ValueError):
        note = f"no checkpoint was saved in {out}; start the run again (--overwrite)"
    print(f"textgym: stopped by {name}; {note}", file=sys.stderr)


def train(cfg: PPOConfig, overwrite: bool = False) -> list[dict[str, float]]:
    """Run PPO; writes ``metrics.jsonl``, ``config.json``, TensorBoard events and checkpoints under ``cfg.out``.

    The run folder is locked while training (a second trainer fails at once). An existing run is
    continued only with ``cfg.resume`` and replaced only with ``overwrite``; see
    :func:`check_resume_config` for what a resume may change. Started by torchrun, every rank
    trains (:mod:`.distributed`) and rank 0 alone locks the folder and writes to it. ``cfg.threads``
    is filled in with the thread count the run uses; the caller's thread count and deterministic mode
    are given back however the run ends.
    """
    from tqdm.auto import tqdm

    from .reporting import make_reporter

    out = Path(cfg.out)
    joined = not distributed.initialized()
    distributed.init(resolve_device(cfg.device))
    main = distributed.is_main()
    with _torch_settings_restored(), _run_folder(out) if main else contextlib.nullcontext():
        trainer, history = _start(out, cfg, overwrite)
        reporter = make_reporter(cfg.report_to, out, cfg.to_dict()) if main else None
        bar = tqdm(total=cfg.num_iterations, initial=trainer.iteration_done, desc="ppo",
                   disable=not (cfg.progress and main))  # fmt: skip
        try:
            while trainer.iteration_done < cfg.num_iterations:
                row = trainer.iteration()
                if main:
                    _record(out, trainer, reporter, bar, row)
                history.append(row)
        finally:
            bar.close()
            if reporter is not None:
                reporter.close()
            trainer.close()
            if joined:
                distributed.leave()
    return history


@contextlib.contextmanager
def _torch_settings_restored():
    """The caller's torch thread count and deterministic mode, given back when the run ends (or fails)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _record(out: Path, trainer: Trainer, reporter, bar, row: dict[str, float]) -> None:
    """Rank 0's part of an iteration: evaluation, samples, the metrics row, the reporters, the checkpoint."""
    cfg = trainer.cfg
    if cfg.eval_every and trainer.iteration_done % cfg.eval_every == 0:
        row.update(trainer.evaluate())
    if cfg.samples_every and trainer.iteration_done % cfg.samples_every == 0:
        _log_samples(out, reporter, trainer.samples())
    with (out / METRICS).open("a") as f:
        f.write(json.dumps(row) + "\n")
    _log_row(reporter, bar, row)
    last = trainer.iteration_done == cfg.num_iterations
    if last:
        bar.close()  # its final line once, before anything the last save prints
    if last or trainer.iteration_done % cfg.checkpoint_every == 0:
        trainer.save(out)
