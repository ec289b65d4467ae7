"""Evaluate any policy on the eval prompts: RM score, gold score, KL to π_ref, RLHF objective, diversity.

One evaluator for every algorithm (the PPO agent, REINFORCE, SB3, the benchmark's baselines): a
policy is anything with ``act(obs) -> (actions (N,), log-probs (N,))`` and ``reset()``, built for
the eval env by a factory; a model folder gets the cached :class:`textgym.policies.LMSampler`.
Episodes come from :func:`textgym.episodes.collect_episodes`, the one episode loop.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from textgym.envs import load_prompts
from textgym.envs.settings import ENV_FIELDS
from textgym.envs.text_rlhf import PARTNER_SEEDS
from textgym.episodes import collect_episodes, episode_score, make_episode_envs, sequence_kl
from textgym.models import EVAL_PROMPTS, EVAL_PROMPTS_BY_ENV, TOKENIZER_FILES, load_causal_lm, load_tokenizer
from textgym.policies import LMSampler
from textgym.reasoning_gym_task import is_spec
from textgym.rewards import registered_names
from textgym.rewards.http import is_url

__all__ = ["RUN_INFO", "distinct_n", "evaluate", "format_eval", "load_sampler", "run_settings", "run_settings_note",
           "split_run_settings"]  # fmt: skip

RUN_INFO = "textgym_run.json"  # beside a saved policy: the β and env settings it was trained with
ENV_SETTINGS = ("kl_coef", *ENV_FIELDS)  # β and textgym.envs.settings.EnvSettings: the one list
SAMPLING = ("top_k", "top_p")  # how a saved policy sampled: it is evaluated sampling the same way


def run_settings(policy: str | None, given: Mapping[str, Any] = ()) -> dict[str, Any]:
    """The settings a saved policy was trained with (``RUN_INFO`` beside it), or {} for π_ref or an HF folder.

    ``kl_coef`` is the β of its last rollout, so score − β·KL is the objective it was updated on;
    ``temperature``, ``top_k`` and ``top_p`` are how it sampled; the rest are env arguments.

    A model folder is data: its run info may name a reward model by a registered name, a path to
    weights or a ``reasoning-gym:`` dataset, never a ``module:attr`` (importing it would run code shipped
    beside the weights) or a URL (the episodes would go to a server the folder chose), and an env only by a
    registered id, never a ``module:EnvName`` (gym.make imports the module), unless the caller gives that same
    argument itself (``given``, e.g. ``--reward-model``).

    Raises:
        ValueError: the run info names a ``module:attr`` or URL reward model, or a ``module:EnvName`` env id,
            that ``given`` does not override.
    """
    path = Path(policy) / RUN_INFO if policy is not None else None
    if path is None or not path.is_file():
        return {}
    run = json.loads(path.read_text())
    run = {k: run[k] for k in (*ENV_SETTINGS, "temperature", *SAMPLING) if k in run}
    for name in ("reward_model", "gold_scorer", "partner"):
        if name not in given and (why := _not_data(run.get(name), name)):
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{path} names {name}={run[name]!r}, {why}; a run-info file may name a {name.replace('_', ' ')} only "
                f"by a registered name, a path to weights, a 'reasoning-gym:' dataset or a 'textarena:' game. "
                "If you trust it, pass it yourself: "
                f"{flag} {run[name]!r} "
                f"(Python: {name}=...)"
            )
    env_id = run.get("env_id")
    if "env_id" not in given and isinstance(env_id, str) and ":" in env_id:
        raise ValueError(
            f"{path} names env_id={env_id!r}, a module that gym.make would import (its code run); a run-info "
            f"file may name an env only by a registered id such as 'TextRLHF-v0'. If you trust it, pass it "
            f"yourself (Python: evaluate(..., env_id={env_id!r}))"
        )
    return run


def _not_data(spec: Any, name: str = "reward_model") -> str | None:
    """Why a run-info file may not choose ``reward_model=spec`` itself (None: it may).

    A ``module:attr`` is imported (see :func:`textgym.rewards.make_reward_model`); a URL gets every
    evaluated episode sent to it: the caller decides both, never a folder that came with the weights.
    """
    if not isinstance(spec, str):
        return None
    if is_url(spec):
        return "a server every evaluated episode would be sent to"
    if name == "partner":  # TextArena's games and the built-in partners are names; anything else is imported code
        return None if spec.startswith("textarena:") or ":" not in spec else "a 'module:attr' that would be imported"
    # a reasoning-gym dataset is a name: it imports the installed reasoning_gym package, no code beside the weights
    if ":" in spec and not is_spec(spec) and spec not in registered_names() and not Path(spec).exists():
        return "a 'module:attr' that would be imported (its code run)"
    return None


def run_settings_note(policy: str | None, given: Mapping[str, Any]) -> str | None:
    """What an evaluation of ``policy`` takes from its run info (settings ``given`` does not override), as text."""
    taken = {k: v for k, v in run_settings(policy, given).items() if k not in given}
    if not taken:
        return None
    listing = ", ".join(f"{k}={v}" for k, v in taken.items())
    return f"from {Path(str(policy)) / RUN_INFO}: {listing} (flags override them)"


def distinct_n(responses: list[list[int]], n: int) -> float:
    """Distinct n-grams / all n-grams over a set of token sequences (Li et al., 2016)."""
    grams = [tuple(r[i : i + n]) for r in responses for i in range(len(r) - n + 1)]
    return len(set(grams)) / max(1, len(grams))


def _policy(envs, policy, policy_factory, seed: int, temperature: float, device: str, **sampling):
    if policy_factory is not None:
        return policy_factory(envs)
    return load_sampler(envs, policy, seed=seed, temperature=temperature, device=device, **sampling)


def load_sampler(envs, policy: str | None, *, seed: int, temperature: float, device: str = "cpu", **sampling):
    """The cached :class:`LMSampler` of a causal-LM folder (None: π_ref, the env's own model) for ``envs``.

    A folder whose vocabulary is not π_ref's is refused first (:func:`_check_vocabulary`).
    """
    base = envs.unwrapped
    policy_model = base.model if policy is None else load_causal_lm(policy, device=device, name="policy")
    if policy is not None:
        _check_vocabulary(policy, policy_model, base)
    generator = torch.Generator(device=policy_model.device).manual_seed(seed)
    return LMSampler.for_env(policy_model, envs, temperature=temperature, generator=generator, **sampling)


def _check_vocabulary(policy: str, model, env) -> None:
    """Refuse a policy whose token ids are not π_ref's: its actions would be out of range, or the wrong tokens.

    Why here: the env reads every action as a token id of π_ref's tokenizer, so a model with another
    vocabulary fails at some random step with an out-of-range action, or (a smaller one) runs on
    silently with the wrong tokens.
    """
    ref = getattr(env.model, "name_or_path", "") or "the embedded LM"
    fix = (f"pass its own π_ref (the model it was fine-tuned from) with --ref-model (Python: model=...); π_ref is "
           f"now {ref!r}")  # fmt: skip
    size, ref_size = model.get_output_embeddings().weight.shape[0], env.single_action_space.n
    if size != ref_size:
        raise ValueError(
            f"policy={policy!r} has a vocabulary of {size} tokens, π_ref has {ref_size}: a policy's actions are "
            f"π_ref's token ids, so the two must share one tokenizer; {fix}"
        )
    if any((Path(policy) / name).is_file() for name in TOKENIZER_FILES):
        if load_tokenizer(policy, name="policy", require_eos=False).get_vocab() != env.tokenizer.get_vocab():
            raise ValueError(f"policy={policy!r} has its own tokenizer, not π_ref's (same size, other tokens); {fix}")


ROW_KEYS = ("rm_score", "score_reward", "missing_eos_penalty", "gold_score", "verdict", "response_length",
            "length_capped", "turns", "turn_reward_sum")  # fmt: skip


def _rows(episodes, prompt_len: int) -> list[dict]:
    """One dict per episode: scores, text, response ids and the sequence's KL estimate."""
    kl = sequence_kl(episodes)  # (B,)
    T = episodes["mask"].shape[1]
    rows = []
    for i in range(episodes.batch_size[0]):
        ids = episodes["input_ids"][i, prompt_len : prompt_len + T][episodes["mask"][i]]  # the policy's tokens
        rows.append({"prompt": episodes["prompt"][i], "response": episodes["response"][i], "kl": float(kl[i]),
                     "ids": ids.tolist(), **{k: episodes[k][i].item() for k in ROW_KEYS}})  # fmt: skip
        if "transcript" in episodes.keys():  # a conversation's whole text, for the samples
            rows[-1]["transcript"] = episodes["transcript"][i]
    return rows


@torch.no_grad()
def evaluate(
    policy: str | None = None,
    *,
    policy_factory: Callable[[Any], Any] | None = None,
    episodes: int = 128,
    num_envs: int = 64,
    seed: int = 1234,
    temperature: float | None = None,
    device: str = "cpu",
    progress: bool | str = False,
    run_of: str | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    **env_kwargs,
) -> dict:
    """Sample ``episodes`` responses on the eval prompts and score them.

    Args:
        policy: a causal-LM folder sampled with :class:`LMSampler` (default: π_ref itself).
        policy_factory: instead of ``policy``: ``factory(envs)`` returns the policy to evaluate.
            Pass the env arguments the policy was trained with (``action_mask_top_p`` for a
            masked policy, ``kl_coef`` = its β): every policy is evaluated as it was trained.
        episodes, num_envs, seed, temperature, device: sampling settings; the eval prompts are
            taken in order (cycled) so every policy answers the same prompts. ``temperature``
            defaults to the run's (below), else 1.
        progress: show a progress bar of the episodes (a str is its label).
        run_of: a policy folder saved by ``textgym train`` whose run settings (:func:`run_settings`)
            define the evaluation (default: ``policy``). ``evaluate(None, run_of="OUT/policy")``
            measures π_ref in that run's env, sampling as the run sampled: the baseline of the
            objective the policy was trained on.
        autocast: the context the policy's forwards run under (a training run's periodic evaluation
            passes its own, so the policy is measured in the precision it samples in during training;
            π_ref and the reward model in the env keep theirs).
        env_kwargs: further ``gym.make`` arguments (``prompts`` defaults to the env's eval split; ``model`` is
            π_ref), and ``env_id`` (default ``"TextRLHF-v0"``). A ``policy`` folder saved by ``textgym train``
            brings the settings it was trained with (:func:`run_settings`), which these override.

    KL to π_ref per sequence is Σ_t log π(a_t|s_t) − log π_ref(a_t|s_t) over the sampled tokens
    (the k1 estimate, unbiased under π); the objective is the return the env pays, score − missing-EOS
    penalty − β·KL with the env's β (``kl_coef`` in the result).

    Returns:
        ``rm_score``, ``score`` (normalised), ``missing_eos_penalty`` (0 or the penalty), ``gold_score``,
        ``kl``, ``objective``, ``response_length`` as ``(mean, std)``; ``length_capped`` (the fraction
        of responses cut at the cap), ``distinct_1``, ``distinct_2``, ``kl_coef``, ``seconds``, ``episodes``;
        ``samples``: the first episodes' prompt, response and scores; ``win_rate`` and the rest of
        :func:`_win_rate` where the task gives verdicts; a conversation's ``turns``, ``turn_reward_sum`` and
        :func:`_multi_turn_share`. Deprecated (issue 43), for one version: ``eos_penalty``, ``success``.
    """
    run_of = policy if run_of is None else run_of
    env_id, temperature, sampling, env_kwargs = _eval_settings(run_of, temperature, env_kwargs)
    num_envs = min(num_envs, episodes)
    envs = make_episode_envs(env_id, num_envs, device=device, **env_kwargs)
    sampler = _policy(envs, policy, policy_factory, seed, temperature, device, **sampling)
    prompts = load_prompts(env_kwargs["prompts"], env_kwargs.get("prompt_column", "prompt"))
    start = time.perf_counter()
    rows = _sample_rows(envs, sampler, prompts, episodes, num_envs, seed, progress, autocast)
    seconds = time.perf_counter() - start
    beta, conversation = envs.unwrapped.kl_coef, envs.unwrapped.has_partner
    envs.close()
    return _summary(rows, beta, seconds, conversation)


def _eval_settings(
    run_of: str | None, temperature: float | None, env_kwargs: dict[str, Any]
) -> tuple[str, float, dict[str, Any], dict[str, Any]]:
    """(env id, temperature, sampling truncation, env arguments) of an evaluation.

    The run's settings (:func:`run_settings`) fill what the caller did not give, so a policy is measured
    in the env and with the sampling it was trained with; the prompts default to the env's eval split.
    """
    run = run_settings(run_of, given=env_kwargs)
    eval_prompts = run.pop("eval_prompts", None)
    env_id, temperature, sampling, env_kwargs = split_run_settings(run, temperature, env_kwargs)
    eval_prompts = eval_prompts or str(EVAL_PROMPTS_BY_ENV.get(env_id, EVAL_PROMPTS))
    return env_id, temperature, sampling, {"prompts": eval_prompts, **env_kwargs}


def split_run_settings(
    run: Mapping[str, Any], temperature: float | None, env_kwargs: dict[str, Any]
) -> tuple[str, float, dict[str, Any], dict[str, Any]]:
    """A run's settings (:func:`run_settings`, less ``eval_prompts``) as (env id, temperature, sampling, env args).

    Why one function: ``eval`` and ``play`` sample a saved policy as it was trained (its temperature and
    top-k/top-p truncation) in its run's env; ``temperature`` and ``env_kwargs`` given override the run's.
    """
    run = dict(run)
    run_temperature = run.pop("temperature", 1.0)
    temperature = temperature if temperature is not None else run_temperature
    sampling = {k: run.pop(k) for k in SAMPLING if k in run}  # the truncation it was trained with
    run_env_id = run.pop("env_id", "TextRLHF-v0")
    env_id = env_kwargs.pop("env_id", None) or run_env_id
    return env_id, temperature, sampling, {**run, **env_kwargs}


def _sample_rows(
    envs, sampler, prompts: list[str], episodes: int, num_envs: int, seed: int, progress: bool | str, autocast
) -> list[dict]:
    """``episodes`` rows of :func:`_rows`, the prompts taken in order (cycled) so every policy answers the same ones.

    Each batch is seeded with ``seed`` plus the episodes before it: the same call samples the same episodes.
    """
    rows: list[dict] = []
    with _progress_bar(episodes, progress) as bar:
        while len(rows) < episodes:
            k = min(num_envs, episodes - len(rows))
            batch = [prompts[(len(rows) + i) % len(prompts)] for i in range(k)]
            games = None
            if envs.unwrapped.has_partner:  # held-out games, the same for every policy: seeds training never draws
                games = [PARTNER_SEEDS + len(rows) + i for i in range(k)]
            done = collect_episodes(envs, sampler, num_episodes=k, prompts=batch, seed=seed + len(rows),
                                    autocast=autocast, partner_seeds=games)  # fmt: skip
            rows.extend(_rows(done, envs.unwrapped.max_prompt_tokens))
            bar.update(k)
    return rows


def _progress_bar(episodes: int, progress: bool | str):
    """A tqdm bar over the episodes (on stderr), or one that shows nothing."""
    from tqdm.auto import tqdm

    label = progress if isinstance(progress, str) else "eval"
    return tqdm(total=episodes, desc=label, unit="episode", disable=not progress, leave=False)


def _summary(rows: list[dict], beta: float, seconds: float, conversation: bool = False) -> dict[str, Any]:
    """Means and stds of the rows; the objective is what the env pays: score − missing-EOS penalty + the partner's
    rewards − β·KL."""
    for r in rows:  # missing_eos_penalty is 0 or the penalty; turn_reward_sum is 0 without a partner
        r["score"] = episode_score(r)  # a conversation's score: its partner's rewards too
        r["objective"] = r["score"] - r["missing_eos_penalty"] - beta * r["kl"]

    def stat(key: str) -> tuple[float, float]:
        values = np.array([r[key] for r in rows], dtype=np.float64)
        return float(values.mean()), float(values.std())

    keys = ("rm_score", "score", "missing_eos_penalty", "gold_score", "kl", "objective", "response_length")
    result: dict[str, Any] = {key: stat(key) for key in keys}
    mean, std = result["missing_eos_penalty"]
    result["eos_penalty"] = (-mean, std)  # deprecated (issue 43), removed in the next version
    if conversation:
        result["turns"], result["turn_reward_sum"] = stat("turns"), stat("turn_reward_sum")
        result.update(_multi_turn_share(rows))
    result.update(_win_rate(rows))
    result["length_capped"] = float(np.mean([r["length_capped"] for r in rows]))
    result["distinct_1"] = distinct_n([r["ids"] for r in rows], 1)
    result["distinct_2"] = distinct_n([r["ids"] for r in rows], 2)
    result["kl_coef"] = beta
    result["seconds"] = seconds
    result["episodes"] = len(rows)
    result["samples"] = [
        {"prompt": r["prompt"], "response": r["response"], "score": float(r["score"]),
         "gold_score": float(r["gold_score"]), "kl": float(r["kl"]),
         **({"transcript": r["transcript"], "turn_reward_sum": r["turn_reward_sum"]} if "transcript" in r else {})}
        for r in rows[:8]
    ]  # fmt: skip
    return result


def _multi_turn_share(rows: list[dict]) -> dict[str, Any]:
    """The share of conversations that went past the policy's first turn, with its Wilson interval: with a tool
    partner, the share that called the tool (a turn without a call is the final answer); in a game, that made a
    move the game answered without ending it."""
    over = int(sum(r["turns"] > 1 for r in rows))
    return {"multi_turn_share": over / len(rows), "multi_turn_share_ci95": list(wilson_interval(over, len(rows)))}


def _win_rate(rows: list[dict]) -> dict[str, Any]:
    """The share of episodes the task's own verdict counts as won or solved (a game's outcome, a verifier's
    judgement; ``verdict`` in the env's final info), with its Wilson interval as a list (the tuples are (mean,
    std)); nothing when the task gives no verdict. Episodes without one (NaN) are not counted."""
    judged = [r["verdict"] for r in rows if not np.isnan(r["verdict"])]
    if not judged:
        return {}
    wins = int(sum(v == 1.0 for v in judged))
    rate, ci = wins / len(judged), list(wilson_interval(wins, len(judged)))
    # success/success_ci95: the names before issue 43, removed in the next version (read win_rate)
    return {"win_rate": rate, "win_rate_ci95": ci, "judged_episodes": len(judged), "success": rate,
            "success_ci95": ci}  # fmt: skip


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a win rate (95 % at z = 1.96): right at 0 and 1 wins, where the normal
    approximation's interval collapses to a point."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


def format_eval(name: str, result: dict) -> str:
    parts = [f"{k} {v[0]:+.3f} ± {v[1]:.3f}" for k, v in result.items() if isinstance(v, tuple)]
    if "win_rate" in result:  # a game's wins, with their 95 % interval
        parts += ["win_rate {:.3f} [{:.3f}, {:.3f}]".format(result["win_rate"], *result["win_rate_ci95"])]
    if "multi_turn_share" in result:  # with a tool: the share of episodes that called it
        parts += ["multi_turn_share {:.3f} [{:.3f}, {:.3f}]".format(result["multi_turn_share"],
                                                                   *result["multi_turn_share_ci95"])]  # fmt: skip
    parts += [f"distinct-2 {result['distinct_2']:.3f}"]
    return f"{name}: " + ", ".join(parts)
