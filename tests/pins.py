"""Values a redesign must not change: seeded episodes of every env and autoreset mode, and the first
iterations' metrics of the demo, ``arith-grpo`` and ``smollm2-guess-ppo`` presets (tiny budgets).

``smollm2-guess-ppo`` trains LoRA adapters, so the test's process stays small. ``python -m tests.pins`` prints them
as JSON; ``python -m tests.pins --write`` stores them in
``tests/data/pins.json`` (with the CPU they were made on), which ``tests/test_pinned.py`` compares
against. Why a child process on one thread: the floats then depend on the code and the CPU only, not on
what else the test worker has run or on how many cores it has.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PINS = Path(__file__).parent / "data" / "pins.json"
TIMING = ("tokens_per_s", "time_")  # metrics that measure the machine, not the run


def cpu_model() -> str:
    """The CPU the values are made on: floats are compared exactly only on the CPU that stored them."""
    from textgym.threads import cpu_name

    return cpu_name()


def _plain(value):
    """A JSON-ready copy: numpy scalars and arrays, tensors and tuples as Python numbers and lists."""
    import numpy as np
    import torch

    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    return value


class Turner:
    """A partner that answers three turns with growing rewards, opening with the seed's own text."""

    def reset(self, seed: int, prompt: str):
        self.k = 0
        return f"game {seed % 5}:" if seed % 2 else None

    def reply(self, conversation):
        self.k += 1
        return f"reply {self.k} to {len(conversation[-1]['content'])}", 0.25 * self.k, self.k >= 3


def _stepped(env_id: str, mode: str, steps: int, **kwargs) -> list[dict]:
    """A vector env of 3 slots stepped with seeded random tokens under ``autoreset_mode=mode``."""
    import gymnasium as gym
    import numpy as np

    import textgym  # noqa: F401

    envs = gym.make_vec(env_id, num_envs=3, vectorization_mode="vector_entry_point", autoreset_mode=mode, **kwargs)
    rng = np.random.default_rng(0)
    obs, info = envs.reset(seed=7)
    out = [{"obs": obs, "info": info}]
    for _ in range(steps):
        vocab = envs.unwrapped.single_action_space.n
        # mostly a few frequent ids (so stop tokens come up), sometimes any id
        actions = np.where(rng.random(3) < 0.3, rng.integers(0, vocab, 3), rng.integers(0, 4, 3))
        obs, reward, terminated, truncated, info = envs.step(actions)
        info = {k: v for k, v in info.items() if k not in ("conversation",)}
        out.append({"obs": obs, "reward": reward, "terminated": terminated, "truncated": truncated, "info": info})
    envs.close()
    return _plain(out)


def _collected(env_id: str, scoring: str, **kwargs) -> dict:
    """One batch of ``collect_episodes`` with π_ref as a seeded sampler (``reference_scoring=scoring``)."""
    from textgym.episodes import collect_episodes, make_episode_envs
    from textgym.policies import LMSampler

    envs = make_episode_envs(env_id, 4, **kwargs)
    sampler = LMSampler.for_env(envs.unwrapped.model, envs, seed=0)
    td = collect_episodes(envs, sampler, seed=3, reference_scoring=scoring)
    envs.close()
    return _plain({k: (list(td.get(k).tolist()) if k in ("prompt", "response", "transcript") else td[k])
                   for k in sorted(td.keys())})  # fmt: skip


def episodes() -> dict:
    """Seeded episodes of the three envs: stepped in both autoreset modes, and collected in both scoring modes."""
    calc = {"partner": "calculator", "max_turn_tokens": 4, "max_new_tokens": 24}
    turner = {"partner": Turner, "max_turn_tokens": 3, "max_new_tokens": 40, "max_turns": 4}
    arith = {"env_id": "TextArithmetic-v0"}
    out = {}
    for mode in ("next_step", "same_step"):
        out[f"rlhf-{mode}"] = _stepped("TextRLHF-v0", mode, 12, max_new_tokens=5)
        out[f"arith-{mode}"] = _stepped(arith["env_id"], mode, 12)
        out[f"calculator-{mode}"] = _stepped("TextMultiTurn-v0", mode, 30, **calc)
        out[f"turner-{mode}"] = _stepped("TextMultiTurn-v0", mode, 40, **turner)
        out[f"turner-episode-{mode}"] = _stepped("TextMultiTurn-v0", mode, 40, reference_scoring="episode", **turner)
        out[f"rlhf-episode-{mode}"] = _stepped("TextRLHF-v0", mode, 12, max_new_tokens=5, reference_scoring="episode")
    for scoring in ("step", "episode"):
        out[f"collect-rlhf-{scoring}"] = _collected("TextRLHF-v0", scoring, max_new_tokens=8)
        out[f"collect-calculator-{scoring}"] = _collected("TextMultiTurn-v0", scoring, **calc)
        out[f"collect-turner-{scoring}"] = _collected("TextMultiTurn-v0", scoring, **turner)
    return out


def iterations(preset: str, count: int, **changes) -> list[dict]:
    """The metrics of the first ``count`` iterations of ``preset`` with ``changes`` (timing left out)."""
    import tempfile

    from textgym.agents.ppo import PPOConfig, Trainer
    from textgym.agents.ppo.config import PRESETS

    with tempfile.TemporaryDirectory() as out:
        cfg = PPOConfig(**{**PRESETS[preset], "out": out, "progress": False, "threads": 1, "precision": "fp32",
                           **changes})  # fmt: skip
        trainer = Trainer.create(cfg)
        rows = [trainer.iteration() for _ in range(count)]
        trainer.envs.close()
    return _plain([{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows])


def pins() -> dict:
    import torch

    torch.set_num_threads(1)
    return {
        "episodes": episodes(),
        "demo": iterations("demo", 2, num_envs=16, total_episodes=32),
        "arith-grpo": iterations("arith-grpo", 2, num_envs=16, total_episodes=32),
        # LoRA r = 16: the full-weight preset's two 135M bodies with their gradients and AdamW moments took this
        # process to 5.49 GiB, the suite's largest (2.29 GiB now); the env, the game and PPO's critic are the preset's
        "smollm2-guess-ppo": iterations(
            "smollm2-guess-ppo",
            2,
            num_envs=2,
            total_episodes=4,
            max_new_tokens=48,
            num_minibatches=1,
            ppo_epochs=1,
            lora_rank=16,
        ),
    }


if __name__ == "__main__":
    values = pins()
    if "--write" in sys.argv[1:]:
        PINS.parent.mkdir(exist_ok=True)
        PINS.write_text(json.dumps({"cpu": cpu_model(), "pins": values}, allow_nan=True) + "\n")
    else:
        print(json.dumps(values, allow_nan=True))
