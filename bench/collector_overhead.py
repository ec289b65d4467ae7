"""The per-token loop at large N: tokens/s of our collector and the share of a rollout spent outside model forwards.

For each N in ``--num-envs``, :func:`textgym.episodes.collect_episodes` collects N episodes of exactly
``--max-new-tokens`` tokens (stop tokens suppressed, as in ``bench/env_throughput.py``) over the native vector
env, the actions sampled by :class:`textgym.policies.LMSampler` over a copy of π_ref. Forward hooks time
every call of the models' ``forward`` (the policy's decode steps, π_ref's episode pass and its chunked LM
head, the reward model and the gold scorer's model where it is one); whatever else the wall time holds is the
loop's own work: the env's bookkeeping, per-slot Python, infos, sampling, the collector. Printed per N:
tokens/s, seconds in forwards, seconds outside, and the share outside (target of issue 41: <= 10 % at
N = 256), after one untimed warm-up, best of ``--repeats``.

    python bench/collector_overhead.py                                  # embedded model, N = 64, 256, 1024
    python bench/collector_overhead.py --config smollm2-sentiment --num-envs 16 64 256 --max-new-tokens 16
    python bench/collector_overhead.py --quick                          # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import textgym  # noqa: E402,F401  (before torch, as a user's run imports it)

# isort: split
import torch  # noqa: E402

from textgym import token_logprobs  # noqa: E402
from textgym.episodes import collect_episodes, make_episode_envs  # noqa: E402
from textgym.models import native_bf16  # noqa: E402
from textgym.policies import LMSampler  # noqa: E402
from textgym.threads import BENCH_THREADS_HELP, default_threads  # noqa: E402

HEAD_LOGPROBS = token_logprobs.head_logprobs


class ForwardClock:
    """Wall seconds inside the ``forward`` of the modules it is attached to (nested calls counted once)."""

    def __init__(self, device: torch.device):
        self.seconds, self._depth, self._start = 0.0, 0, 0.0
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # time kernels, not launches

    def attach(self, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave)

    def wrap(self, fn):
        """``fn`` timed as a forward: the LM head that runs on the hidden states, outside the model's forward."""

        def timed(*args, **kwargs):
            self._enter(None, args)
            try:
                return fn(*args, **kwargs)
            finally:
                self._leave(None, args, None)

        return timed

    def _enter(self, module, args) -> None:
        if self._depth == 0:
            self._sync()
            self._start = time.perf_counter()
        self._depth += 1

    def _leave(self, module, args, out) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._sync()
            self.seconds += time.perf_counter() - self._start


class NoStop(LMSampler):
    """An :class:`LMSampler` that never samples a stop token: every episode runs ``max_new_tokens`` steps."""

    stop_ids: list[int] = []

    @torch.no_grad()
    def logits(self, obs):
        out = super().logits(obs)
        out[:, self.stop_ids] = -float("inf")
        return out


def measure(n: int, args, env_kwargs: dict) -> dict[str, float]:
    """Best of ``args.repeats`` rollouts of ``n`` episodes (after a warm-up): seconds, forward seconds, tokens."""
    device = torch.device(args.device)
    envs = make_episode_envs("TextRLHF-v0", n, **{**env_kwargs, "max_new_tokens": args.max_new_tokens,
                                                  "device": device})  # fmt: skip
    base = envs.unwrapped
    clock = ForwardClock(device)
    token_logprobs.head_logprobs = clock.wrap(HEAD_LOGPROBS)  # π_ref's episode pass: the head is model work too
    policy_model = copy.deepcopy(base.model)
    for model in (policy_model, base.model, getattr(base.reward_model, "model", None),
                  getattr(base.gold_scorer, "model", None)):  # fmt: skip
        if isinstance(model, torch.nn.Module):
            clock.attach(model)
    policy = NoStop.for_env(policy_model, envs, generator=torch.Generator(device=device).manual_seed(0))
    policy.stop_ids = sorted({base.eos_token_id, *base.stop_token_ids})
    prompts = [base.prompts[i % len(base.prompts)] for i in range(n)]
    bf16 = native_bf16(device) if args.precision == "auto" else args.precision == "bf16"

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    best = None
    for repeat in range(args.repeats + 1):
        clock.seconds = 0.0
        clock._sync()
        start = time.perf_counter()
        episodes = collect_episodes(envs, policy, prompts=prompts, autocast=autocast)
        clock._sync()
        wall = time.perf_counter() - start
        row = {"seconds": wall, "forward": clock.seconds, "tokens": int(episodes["response_length"].sum())}
        if repeat and (best is None or wall < best["seconds"]):  # repeat 0 is the warm-up
            best = row
    envs.close()
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-envs", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--config", default=None, help="a textgym train preset whose env to use (model, prompts, RM)")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=default_threads(), help=BENCH_THREADS_HELP)
    parser.add_argument("--quick", action="store_true", help="N = 4, 8 and 4 tokens: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_envs, args.max_new_tokens, args.repeats = [4, 8], 4, 1
    torch.set_num_threads(args.threads)
    env_kwargs = {}
    if args.config:
        from textgym.agents.ppo import PPOConfig
        from textgym.agents.ppo.config import PRESETS

        env_kwargs = PPOConfig(**{**PRESETS[args.config], "out": "/tmp/textgym-collector-bench"}).env_kwargs()
    print(
        f"collector at large N: {args.config or 'embedded'}, {args.max_new_tokens} tokens an episode, precision "
        f"{args.precision}, device {args.device}, {args.threads} threads; best of {args.repeats} after a warm-up"
    )
    print(f"  {'N':>6} {'tokens/s':>10} {'forwards s':>11} {'outside s':>10} {'outside %':>10}")
    for n in args.num_envs:
        row = measure(n, args, env_kwargs)
        outside = row["seconds"] - row["forward"]
        print(f"  {n:>6} {row['tokens'] / row['seconds']:10.1f} {row['forward']:11.3f} {outside:10.3f} "
              f"{100 * outside / row['seconds']:9.1f} %", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
