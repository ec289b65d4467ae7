"""TextMultiTurn-v0 on a device: the conversation's checks of tests/test_multi_turn.py where π_ref, the sampler and
the trainer run on ``--device`` (CUDA on the GPU machine; ``bench/gpu_smoke.sh multiturn``), with the embedded model.

Prints one JSON line per check and exits non-zero if one fails:
  1. both reference modes give the same per-token log π_ref and rewards (|Δ| <= 1e-4) and nothing on a partner's tokens;
  2. the episode's return is Σ turn rewards + final score + β·Σ log π_ref of an independent full forward;
  3. a PPO and a GRPO iteration run on the device (seconds, peak memory).

    python bench/gpu_multiturn.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import textgym  # noqa: F401  (before torch, as in a user's run: its OpenMP wait applies; registers the env)

# isort: split
import torch

from textgym.episodes import collect_episodes, make_episode_envs
from textgym.models import response_logits
from textgym.policies import LMSampler

BETA = 0.1


class Counter:
    """Answers ``reply k`` to turn k with reward 0.5·k; done after three turns."""

    def reset(self, *, seed, prompt):
        self.k = 0

    def reply(self, conversation):
        self.k += 1
        return f"reply {self.k}", 0.5 * self.k, self.k >= 3


def length_score(prompts, responses):
    return [len(r) / 10 for r in responses]


def both_modes(device: str) -> dict:
    envs = make_episode_envs("TextMultiTurn-v0", 8, partner=Counter, max_turn_tokens=4, max_new_tokens=48,
                             kl_coef=BETA, reward_model=length_score, device=device)  # fmt: skip
    base, out = envs.unwrapped, {}
    for mode in ("step", "episode"):
        sampler = LMSampler.for_env(base.model, envs, generator=torch.Generator(device=device).manual_seed(0))
        out[mode] = collect_episodes(envs, sampler, seed=0, reference_scoring=mode)
    a, b = out["step"], out["episode"]
    gap = max(float((a[k] - b[k]).abs().max()) for k in ("ref_logprob", "env_reward"))
    off = float(b["env_reward"][~b["mask"]].abs().max()) if (~b["mask"]).any() else 0.0
    same = torch.equal(a["action"], b["action"]) and torch.equal(a["mask"], b["mask"])
    ret = _independent_return(base, b)
    return {"check": "modes and return", "same_tokens": same, "max_abs_gap": gap, "paid_on_partner_tokens": off,
            "return_gap": ret, "ok": same and gap <= 1e-4 and off == 0.0 and ret <= 1e-3}  # fmt: skip


def _independent_return(base, ep) -> float:
    """Largest |Σ env rewards − (turn rewards + score + β Σ log π_ref of a plain full forward)| over the episodes."""
    P = base.max_prompt_tokens
    ids, mask = ep["input_ids"].to(base.model.device), ep["attention_mask"].to(base.model.device)
    with torch.no_grad():
        logp = torch.log_softmax(response_logits(base.model, ids, mask, P).double(), -1)  # (B, T, V)
    T = ep["mask"].shape[1]
    ref = logp.gather(-1, ids[:, P : P + T, None]).squeeze(-1).cpu() * ep["mask"]
    want = ep["turn_reward_sum"] + ep["score_reward"] + BETA * ref.sum(1)
    return float((ep["env_reward"].double().sum(1) - want).abs().max())


class Terse(Counter):
    def reply(self, conversation):
        text, _, done = super().reply(conversation)
        return text, max(-1.0, 1.0 - len(conversation[-1]["content"]) / 20), done


def iterations(device: str) -> list[dict]:
    from textgym.agents.ppo import PPOConfig, Trainer

    rows = []
    for algo in ("ppo", "grpo"):
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        cfg = PPOConfig(env_id="TextMultiTurn-v0", max_new_tokens=36, max_turn_tokens=6, num_envs=16, total_episodes=32,
                        num_minibatches=2, ppo_epochs=1, algo=algo, group_size=4, device=device, progress=False,
                        out=f"/tmp/gpu_multiturn_{algo}")  # fmt: skip
        t = Trainer.create(cfg, env_overrides={"partner": Terse})
        start = time.perf_counter()
        row = t.iteration()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
        ok = all(torch.isfinite(torch.tensor(row[k])) for k in ("policy_loss", "kl", "score"))
        on_device = next(t.policy.parameters()).device.type == torch.device(device).type
        rows.append({"check": f"{algo} iteration", "seconds": round(seconds, 2), "peak_gib": round(peak, 3),
                     "score": round(row["score"], 4), "ok": bool(ok and on_device)})  # fmt: skip
        t.envs.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    rows = [both_modes(args.device), *iterations(args.device)]
    for row in rows:
        print(json.dumps(row), flush=True)
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
