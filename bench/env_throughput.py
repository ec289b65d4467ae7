"""Rollout throughput of the native vector env against the Hugging Face / TRL reference point.

For each N in ``--num-envs`` this script times, in the same process and interleaved so that
machine noise hits both sides alike:

* **env**: our collector, :func:`textgym.episodes.collect_episodes`, over the native vector env of
  N slots (``make_episode_envs``) on N given prompts, until every slot's episode has ended, the
  actions sampled by the reference policy (:class:`textgym.policies.LMSampler` over a *separate
  copy* of π_ref, with its own KV cache), under the policy's autocast as the trainer runs it. The
  env does its own work: with ``--reference-scoring episode`` (the collector's default) one
  teacher-forced π_ref forward over the episodes that end together, with ``step`` (a Gym agent
  stepping by hand) one batched cached π_ref forward per step; and at the end one batched
  reward-model call (plus the gold scorer when one is configured, as it is by default).
* **reference** (what TRL's PPO rollout does): ``model.generate`` with KV cache on the same
  prompts (left padding, pad/EOS ids of the env tokenizer) by the same policy copy, the policy
  log-probs of the sampled tokens gathered from the generation scores, then ONE batched
  teacher-forced forward of π_ref for the log-probs of the generated tokens
  (:func:`textgym.models.response_logprobs`) and ONE batched reward-model call over the
  finished sequences (the RM's ``.model`` run on the generated ids when the RM shares the env
  tokenizer, as TRL does; its ``.score(Episodes)`` otherwise).

Both sides therefore produce the same things: T sampled tokens per prompt, their policy
log-probs, their π_ref log-probs and one RM score per sequence.

Fairness scheme (equal lengths): both sides generate **exactly** ``max_new_tokens`` (T)
tokens per prompt, sampled at temperature 1 from π_ref with the EOS logit set to −inf and no
other change to the distribution:

* reference: ``generate(do_sample=True, suppress_tokens=[eos], top_k=0, top_p=1.0,
  temperature=1.0, max_new_tokens=T)`` (``top_k=0`` turns off transformers' implicit top-50);
* env: the policy's next-token logits get ``logits[:, eos] = -inf`` before
  ``LMSampler.act`` samples (and on every other stop id of the env), so no episode terminates
  early and every slot reaches the length cap after exactly T steps.

No EOS means no early stops on either side, so both do prefill + T−1 cached decode steps per
prompt and the token counts match (N·T each; the script prints a warning if they do not).
The env is used in steady state: the same env and policy serve the warm-up and every repeat,
as in a collector loop.

Timing: per N, one untimed warm-up of each side, then ``--repeats`` rounds, each timing the env
and the reference back to back, alternating which goes first. tokens/s = N·T / wall time;
the ratio env/reference is computed from the best (fastest) run of each side, and the median
ratio is printed beside it. torch keeps its default thread count (printed) unless
``--threads`` is given; on a machine shared with other jobs, intra-op threads contend with them
and timings get very noisy (``--threads 1`` is steadier there). Results are printed, never
asserted; the last line is ``ratio at N=64: X (target >= 0.9)`` (or says N=64 was not run).

A real model: ``--config smollm2-sentiment`` takes a ``textgym train`` preset's env (model, chat
prompts, reward model) and ``--model`` any model folder or name; ``--hf-fast`` also times Hugging
Face's own fastest path on the same work (``cache_implementation="static"`` with the decode step
under ``torch.compile``, as transformers documents for overhead-bound models), printed as the
env's ratio to it.

Usage::

    python bench/env_throughput.py                      # N = 1, 16, 64, 256; T = 32; 3 repeats
    python bench/env_throughput.py --config smollm2-sentiment --num-envs 16 64 --max-new-tokens 48 --precision fp32
    python bench/env_throughput.py --config smollm2-sentiment --num-envs 16 --max-new-tokens 48 --hf-fast
    python bench/env_throughput.py --precision fp32     # the policy's forwards in fp32 on both sides
    python bench/env_throughput.py --num-envs 16 --repeats 1
    python bench/env_throughput.py --decoder dynamic    # the acting policy on a DynamicCache (default: auto)
    python bench/env_throughput.py --quick              # tiny smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import textgym  # noqa: E402,F401  (before torch, as in a user's run: its OpenMP wait applies; registers the env)

# isort: split
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from textgym.episodes import collect_episodes, make_episode_envs  # noqa: E402
from textgym.functional import position_ids_from_mask  # noqa: E402
from textgym.models import left_pad, load_causal_lm, native_bf16, response_logprobs  # noqa: E402
from textgym.policies import LMSampler  # noqa: E402
from textgym.rewards import Episodes, score_checked  # noqa: E402
from textgym.ring_decoder import DECODERS  # noqa: E402
from textgym.threads import BENCH_THREADS_HELP, default_threads  # noqa: E402

TARGET_N = 64
TARGET_RATIO = 0.9
QUICK = {"num_envs": [1, 8], "max_new_tokens": 4, "repeats": 1}
DEFAULT = {"num_envs": [1, 16, 64, 256], "max_new_tokens": 32, "repeats": 3}


class NoEOSPolicy(LMSampler):
    """:class:`LMSampler` that never samples a stop token (their logits are −inf), so episodes run T steps."""

    stop_ids: list[int] = []  # the env's stop_token_ids, set by make_case

    @torch.no_grad()
    def logits(self, obs: dict[str, np.ndarray | Tensor]) -> Tensor:
        out = super().logits(obs)
        out[:, [self.eos, *self.stop_ids]] = -float("inf")
        return out


@dataclass
class Case:
    """Everything timed for one N: the env, the policy acting in it, and the reference inputs."""

    n: int
    max_new_tokens: int
    envs: Any
    policy: NoEOSPolicy
    prompts: list[str]
    input_ids: Tensor  # (N, P) left-padded prompts for generate
    attention_mask: Tensor  # (N, P)
    env_times: list[float] = field(default_factory=list)
    ref_times: list[float] = field(default_factory=list)
    fast_times: list[float] = field(default_factory=list)  # --hf-fast: static cache + torch.compile
    fast_model: Any = None  # --hf-fast: a copy of the policy whose forward is compiled (the other sides stay eager)
    env_tokens: int = 0
    ref_tokens: int = 0
    autocast: Callable[[], Any] = contextlib.nullcontext  # the policy's forwards on both sides (--precision)
    reference_scoring: str = "episode"  # how the env scores π_ref (--reference-scoring)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_case(n: int, max_new_tokens: int, policy_model: Any, device: torch.device, seed: int,
              env_kwargs: dict[str, Any] | None = None, decoder: str = "auto") -> Case:  # fmt: skip
    """Build the vector env for N slots, the policy over ``policy_model`` and the reference prompts."""
    envs = make_episode_envs("TextRLHF-v0", n, **{**(env_kwargs or {}), "max_new_tokens": max_new_tokens,
                                                  "device": device})  # fmt: skip
    base = envs.unwrapped
    all_prompts = list(base.prompts)
    prompts = [all_prompts[i % len(all_prompts)] for i in range(n)]
    tok = base.tokenizer
    encoded = base.encode_prompts(prompts)  # the env's own encoding (chat template, BOS for "")
    input_ids, attention_mask = left_pad(tok, encoded, pad_id=base.pad_token_id)
    g = torch.Generator(device=device).manual_seed(seed)
    policy = NoEOSPolicy.for_env(policy_model, envs, temperature=1.0, generator=g, decoder=decoder)
    policy.stop_ids = list(base.stop_token_ids)
    return Case(n, max_new_tokens, envs, policy, prompts, input_ids.to(device), attention_mask.to(device))


def run_env(case: Case, device: torch.device) -> tuple[float, int]:
    """One rollout of N episodes through our collector; returns (seconds, tokens generated)."""
    _sync(device)
    start = time.perf_counter()
    episodes = collect_episodes(case.envs, case.policy, prompts=case.prompts, autocast=case.autocast,
                                reference_scoring=case.reference_scoring)  # fmt: skip
    _sync(device)
    return time.perf_counter() - start, int(episodes["response_length"].sum())


def _reference_rm(rm: Any) -> Callable[[Tensor, Tensor, int, Any], Tensor | np.ndarray]:
    """The reference RM call: the HF classifier on the generated ids when it shares the tokenizer."""
    model = getattr(rm, "model", None)
    if getattr(rm, "shares_tokenizer", False) and isinstance(model, torch.nn.Module):
        label = int(getattr(rm, "label", 0))
        rm_pad = model.config.pad_token_id

        @torch.no_grad()
        def on_ids(seq: Tensor, mask: Tensor, prompt_len: int, tokenizer: Any) -> Tensor:
            ids = seq.masked_fill(mask == 0, rm_pad) if rm_pad is not None else seq
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
            return out.logits[:, label].float()

        return on_ids

    def on_text(seq: Tensor, mask: Tensor, prompt_len: int, tokenizer: Any) -> np.ndarray:
        prompt_rows = zip(seq[:, :prompt_len], mask[:, :prompt_len], strict=True)
        prompt_ids = [row[m.bool()].tolist() for row, m in prompt_rows]
        response_ids = seq[:, prompt_len:].tolist()
        episodes = Episodes(
            prompts=tokenizer.batch_decode(prompt_ids, skip_special_tokens=True),
            responses=tokenizer.batch_decode(response_ids, skip_special_tokens=True),
            prompt_ids=prompt_ids,
            response_ids=response_ids,
        )
        return score_checked(rm, episodes)

    return on_text


@torch.no_grad()
def run_reference(case: Case, ref_model: Any, device: torch.device, seed: int) -> tuple[float, int]:
    """HF generate (KV cache) + one π_ref scoring forward + one RM call; returns (seconds, tokens)."""
    base = case.envs.unwrapped
    eos, pad, T = base.eos_token_id, base.pad_token_id, case.max_new_tokens
    rm_call = _reference_rm(base.reward_model)
    torch.manual_seed(seed)
    _sync(device)
    start = time.perf_counter()
    with case.autocast():
        out = _generate(case, T, eos, pad)
    seq = out.sequences  # (N, P + T): [left-padded prompt][response]
    prompt_len = case.input_ids.shape[1]
    response = seq[:, prompt_len:]
    # Policy log-probs of the sampled tokens from the generation scores (as TRL does).
    step_logps = [torch.log_softmax(s.float(), -1).gather(-1, response[:, t, None]) for t, s in enumerate(out.scores)]
    _policy_logp = torch.cat(step_logps, dim=1)  # (N, T)
    mask = torch.cat([case.attention_mask, torch.ones_like(response)], dim=1)  # no EOS, so no padding after it
    _ref_logp, _ = response_logprobs(ref_model, seq, mask, prompt_len)
    _scores = rm_call(seq, mask, prompt_len, base.tokenizer)
    _sync(device)
    elapsed = time.perf_counter() - start
    generated = response.shape[0] * response.shape[1]
    if (response == eos).any():
        print(f"  warning: reference generated EOS at N={case.n}; suppress_tokens was not honoured")
    return elapsed, generated


def _generate(case: Case, T: int, eos: int, pad: int, model: Any = None, **fast):
    """The reference's sampling: ``generate`` with KV cache, exactly T tokens, the scores kept.

    ``model``: another copy of the policy (``--hf-fast``: its forward compiled); ``fast``:
    ``cache_implementation="static"``.
    """
    base = case.envs.unwrapped
    return (model or case.policy.model).generate(
        input_ids=case.input_ids,
        attention_mask=case.attention_mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=T,
        suppress_tokens=list(base.stop_token_ids),
        eos_token_id=eos,
        pad_token_id=pad,
        use_cache=True,
        return_dict_in_generate=True,
        output_scores=True,
        **fast,
    )


@torch.no_grad()
def run_hf_fast(case: Case, ref_model: Any, device: torch.device, seed: int) -> float:
    """As :func:`run_reference`, with ``generate``'s static cache and compiled decode step; returns seconds."""
    base = case.envs.unwrapped
    rm_call = _reference_rm(base.reward_model)
    torch.manual_seed(seed)
    _sync(device)
    start = time.perf_counter()
    with case.autocast():
        out = _generate(case, case.max_new_tokens, base.eos_token_id, base.pad_token_id, model=case.fast_model,
                        cache_implementation="static")  # fmt: skip
    seq, prompt_len = out.sequences, case.input_ids.shape[1]
    mask = torch.cat([case.attention_mask, torch.ones_like(seq[:, prompt_len:])], dim=1)
    response_logprobs(ref_model, seq, mask, prompt_len)
    rm_call(seq, mask, prompt_len, base.tokenizer)
    _sync(device)
    return time.perf_counter() - start


def bench_case(case: Case, ref_model: Any, device: torch.device, repeats: int, seed: int, fast: bool = False) -> None:
    """Warm up every side once (``fast``: compiling too), then time ``repeats`` interleaved rounds."""
    sides = ("env", "ref", "fast") if fast else ("env", "ref")
    run_env(case, device)
    run_reference(case, ref_model, device, seed)
    if fast:
        run_hf_fast(case, ref_model, device, seed)
    for r in range(repeats):
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:  # each side goes first in turn
            if side == "env":
                dt, case.env_tokens = run_env(case, device)
                case.env_times.append(dt)
            elif side == "ref":
                dt, case.ref_tokens = run_reference(case, ref_model, device, seed + 1 + r)
                case.ref_times.append(dt)
            else:
                case.fast_times.append(run_hf_fast(case, ref_model, device, seed + 1 + r))


def report(case: Case) -> float:
    """Print one N's line; return the env/reference ratio from the best runs."""
    expected = case.n * case.max_new_tokens
    for side, got in (("env", case.env_tokens), ("reference", case.ref_tokens)):
        if got != expected:
            print(f"  warning: {side} generated {got} tokens at N={case.n}, expected {expected}")
    env_best, ref_best = min(case.env_times), min(case.ref_times)
    env_med, ref_med = statistics.median(case.env_times), statistics.median(case.ref_times)
    ratio = ref_best / env_best  # = (tokens/env_best) / (tokens/ref_best) with equal token counts
    ratio_med = ref_med / env_med
    fast = ""
    if case.fast_times:  # same token count as the reference (exactly N·T)
        fast_best = min(case.fast_times)
        fast = f" {case.ref_tokens / fast_best:>12.1f} {fast_best / env_best:>8.3f}"
    print(
        f"{case.n:>5} {case.env_tokens:>7} {case.env_tokens / env_best:>12.1f} {case.env_tokens / env_med:>12.1f} "
        f"{case.ref_tokens / ref_best:>12.1f} {case.ref_tokens / ref_med:>12.1f} {ratio:>8.3f} {ratio_med:>8.3f}{fast}",
        flush=True,
    )
    return ratio


def policy_autocast(precision: str, device: torch.device) -> Callable[[], Any]:
    """The context the policy's forwards run in: what ``PPOConfig(precision=...)`` gives the trainer."""
    if precision == "bf16" or (precision == "auto" and native_bf16(device)):
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def env_settings(config: str | None, model: str | None) -> dict[str, Any]:
    """The env arguments of a ``textgym train`` preset (none: the embedded task), ``model`` over them."""
    kwargs: dict[str, Any] = {}
    if config is not None:
        from textgym.agents.ppo.config import PRESETS, PPOConfig

        kwargs = PPOConfig(**PRESETS[config]).env_kwargs()
        kwargs.pop("max_new_tokens")  # the bench's T
    if model is not None:
        kwargs["model"] = model
    return kwargs


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring for the fairness scheme.",
    )
    parser.add_argument(
        "--num-envs", type=int, nargs="+", default=None, help=f"values of N (default {DEFAULT['num_envs']})"
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help=f"tokens per episode T (default {DEFAULT['max_new_tokens']})"
    )
    parser.add_argument("--repeats", type=int, default=None, help=f"timed rounds per N (default {DEFAULT['repeats']})")
    parser.add_argument("--quick", action="store_true", help=f"tiny smoke run: {QUICK} unless given explicitly")
    parser.add_argument("--device", default="cpu", help="torch device for all models (default cpu)")
    parser.add_argument("--threads", type=int, default=default_threads(), help=BENCH_THREADS_HELP)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument(
        "--precision", choices=("auto", "fp32", "bf16"), default="auto",
        help="the policy's forwards on both sides (env sampling, generate): bf16 autocast or fp32; auto = bf16 where "
        "the device has native bf16, as `textgym train` does (default). π_ref scoring and the RM stay fp32",
    )  # fmt: skip
    parser.add_argument("--config", default=None, help="a textgym train preset whose env to use (smollm2-sentiment: "
                        "SmolLM2-135M, chat prompts, the response RM); default: the embedded task")  # fmt: skip
    parser.add_argument("--model", default=None, help="π_ref and the acting policy (a folder or a name such as "
                        "smollm2-135m-instruct; default: the preset's, else the embedded LM)")  # fmt: skip
    parser.add_argument("--reference-scoring", choices=("episode", "step"), default="episode",
                        help="how the env scores π_ref: once per finished episode (the collectors' default) or "
                        "a cached forward per step (a Gym agent stepping by hand)")  # fmt: skip
    parser.add_argument("--decoder", choices=DECODERS, default="auto", help="the acting policy's KV cache "
                        "(textgym/ring_decoder.py; auto: the ring; graph: its step as a CUDA graph)")  # fmt: skip
    parser.add_argument("--hf-fast", action="store_true", help="also time generate with a static cache and the "
                        "model's forward under torch.compile (HF's fastest path; compiling takes minutes)")  # fmt: skip
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else DEFAULT
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if any(n < 1 for n in args.num_envs) or args.max_new_tokens < 1 or args.repeats < 1:
        parser.error("--num-envs, --max-new-tokens and --repeats must be >= 1")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    env_kwargs = env_settings(args.config, args.model)
    policy_model = load_causal_lm(env_kwargs.get("model"), device=device)  # the acting copy, separate from the env's
    # as the trainer's policy, whose weights train: autocast then casts them to bf16 once per region (the
    # collector's rollout, generate's call) instead of at every forward; both sides sample with this copy
    policy_model.requires_grad_(True)
    fast_model = None
    if args.hf_fast:  # transformers' recipe, on a copy of its own: compile the forward, generate with a static cache
        fast_model = load_causal_lm(env_kwargs.get("model"), device=device)
        fast_model.forward = torch.compile(fast_model.forward)
    print(
        f"env throughput vs HF generate + π_ref scoring + RM | T={args.max_new_tokens} repeats={args.repeats} "
        f"model={env_kwargs.get('model', 'embedded')} device={device} torch threads={torch.get_num_threads()} "
        f"policy precision={args.precision} reference_scoring={args.reference_scoring} decoder={args.decoder} "
        f"({'bf16' if policy_autocast(args.precision, device) is not contextlib.nullcontext else 'fp32'})"
    )
    print("tok/s = generated tokens per wall second; ratio = env tok/s / reference tok/s (best; median)")
    print(
        f"{'N':>5} {'tokens':>7} {'env best':>12} {'env median':>12} {'ref best':>12} {'ref median':>12} "
        f"{'ratio':>8} {'ratio md':>8}" + (f" {'hf-fast best':>12} {'env/fast':>8}" if args.hf_fast else ""),
        flush=True,
    )
    ratios: dict[int, float] = {}
    for n in args.num_envs:
        case = make_case(n, args.max_new_tokens, policy_model, device, args.seed, env_kwargs, args.decoder)
        case.autocast = policy_autocast(args.precision, device)
        case.reference_scoring = args.reference_scoring
        case.fast_model = fast_model
        try:
            bench_case(case, case.envs.unwrapped.model, device, args.repeats, args.seed, args.hf_fast)
        finally:
            case.envs.close()
        ratios[n] = report(case)
    print(f"total wall time {time.perf_counter() - t_start:.1f} s")
    if TARGET_N in ratios:
        print(f"ratio at N={TARGET_N}: {ratios[TARGET_N]:.3f} (target >= {TARGET_RATIO})")
    else:
        largest = max(ratios)
        print(
            f"ratio at N={TARGET_N}: not measured (largest N run: {largest}, ratio {ratios[largest]:.3f}) "
            f"(target >= {TARGET_RATIO})"
        )


if __name__ == "__main__":
    main()
