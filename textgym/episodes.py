"""The one episode loop: complete episodes from the native vector env, as a TensorDict.

Every consumer of episodes uses it: the PPO rollout, the evaluator, reward-model calibration,
``textgym play``, and (next) GRPO groups and Ray rollout workers. RLHF needs exactly one
*complete* episode per slot (the reward-model score comes at its end), laid out episode by
episode so an update runs one teacher-forced forward per sequence. TorchRL's collectors hand out
fixed-length time slices with auto-reset, which cut episodes across batches; so this loop drives
the Gymnasium vector env directly, with autoreset disabled: a finished slot waits (its action is
ignored) until every slot has finished.

Speed by design: the rewards are read only once the episodes have ended, so the loop asks the env
to score π_ref at each episode's end (``reference_scoring="episode"``): one teacher-forced forward
over the finished episodes instead of a cached π_ref decode beside the policy at every step. The
env's ``token_rewards`` put back on the tokens give the per-step rewards stepping pays (see
``TextRLHFEnv``, Rewards). The policy's autocast region is opened once for the whole loop, so its
fp32 weights are cast to bf16 once per rollout, not once per token (autocast caches the casts of
the weights that require grad until the outermost region closes); the env runs π_ref and the
reward models outside it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from gymnasium.vector import AutoresetMode
from tensordict import NonTensorStack, TensorDict

__all__ = ["FINAL_INFO_KEYS", "collect_episodes", "episode_score", "make_episode_envs", "paid_score", "sequence_kl"]

# Per-episode results copied from the env's last-step info, with their dtypes: ``missing_eos_penalty`` is 0 or the
# penalty subtracted (``eos_penalty``, its negative, is the name before issue 43, kept for one version);
# ``verdict`` the task's own (1.0 won or solved, 0.0 not, NaN: the task gives none); ``response_length`` counts
# the policy's tokens.
FINAL_INFO_KEYS = {"rm_score": np.float64, "score_reward": np.float64, "missing_eos_penalty": np.float64,
                   "eos_penalty": np.float64, "gold_score": np.float64, "verdict": np.float64,
                   "response_length": np.int64, "length_capped": np.bool_}  # fmt: skip
# ... and those of a conversation (TextMultiTurn-v0), with what a single-turn episode has instead: one turn, no
# partner reward (``turn_reward_sum``: a partner's rewards), its response the whole conversation.
TURN_INFO_KEYS = {"turns": (np.int64, 1), "turn_reward_sum": (np.float64, 0.0)}


def make_episode_envs(env_id: str = "TextRLHF-v0", num_envs: int = 1, **env_kwargs):
    """The native vector env :func:`collect_episodes` drives: ``num_envs`` slots, autoreset disabled.

    ``gym.make_vec(env_id, num_envs, vectorization_mode="vector_entry_point", autoreset_mode="disabled",
    **env_kwargs)``: the one place that setup is written (the trainer, its Ray workers, evaluation,
    calibration, REINFORCE and ``textgym play`` build their envs here).
    """
    import gymnasium as gym  # the env ids are registered: textgym's __init__ ran before this module

    return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point", autoreset_mode="disabled",
                        **env_kwargs)  # fmt: skip


def sequence_kl(episodes: TensorDict) -> torch.Tensor:
    """Each episode's k1 KL to π_ref, Σ_t log π(a_t|s_t) − log π_ref(a_t|s_t) over its response ``(B,)``.

    With the sampler's own log-probs this is the single-sample estimate of KL(π‖π_ref) every report
    (the trainer's samples, the evaluation, ``textgym play``) gives per sequence.
    """
    return ((episodes["sample_log_prob"] - episodes["ref_logprob"]) * episodes["mask"]).sum(1)


def transcript(conversation: list[dict[str, str]]) -> str:
    """A conversation's chat messages as text, one ``role: content`` block per message."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in conversation)


def _as_numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)


def _check_envs(envs) -> None:
    mode = getattr(envs.unwrapped, "autoreset_mode", None)
    if mode != AutoresetMode.DISABLED:
        raise ValueError(
            f"envs has autoreset_mode={mode!r}; collect_episodes needs a TextRLHF vector env made with "
            "autoreset_mode='disabled' (finished slots wait for the others)"
        )


def _start_mask(num_envs: int, num_episodes: int | None) -> np.ndarray:
    n = num_envs if num_episodes is None else num_episodes
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= num_envs:
        raise ValueError(f"num_episodes={num_episodes!r} must be an int in [1, num_envs={num_envs}] or None")
    mask = np.zeros(num_envs, dtype=bool)
    mask[:n] = True
    return mask


def collect_episodes(
    envs,
    policy,
    *,
    num_episodes: int | None = None,
    prompts: Sequence[str] | None = None,
    seed: int | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    timing: dict[str, float] | None = None,
    reference_scoring: str | None = None,
    partner_seeds: Sequence[int] | None = None,
) -> TensorDict:
    """Run one complete episode in each of the first ``num_episodes`` slots of ``envs``.

    Args:
        envs: a ``TextRLHFVectorEnv`` made with ``autoreset_mode="disabled"``.
        policy: ``reset()`` and ``act(obs) -> (actions (N,), log-probs (N,))`` (tensors or arrays);
            the log-prob is that of the distribution the action was drawn from. A truncating sampler
            leaves that distribution's support, packed, in ``policy.last_kept`` (``LMSampler.act``).
        num_episodes: slots to run (default: all ``num_envs``); the others stay idle.
        prompts: one prompt per episode (default: drawn by the env's per-slot RNGs). Giving the
            same prompt G times makes a group of G episodes on one prompt.
        seed: passed to ``envs.reset`` (slot i is seeded with ``seed + i``).
        autocast: a context-manager factory: one region over the loop, the policy's forwards run in it.
        timing: if given, receives ``seconds`` (the whole loop) and ``policy_seconds``.
        reference_scoring: ``"episode"`` (π_ref once at each episode's end) or ``"step"`` (a cached forward
            per step): equal to 1e-5; default "episode", "step" for an env with ``action_mask_top_p``.
        partner_seeds: with a partner (``TextMultiTurn-v0``), one seed per episode (a game's deal; default: the
            slots' RNGs draw them). A seed given G times makes a group on one game.

    Returns:
        A TensorDict of batch size ``(B,)``, B = ``num_episodes``, T = ``max_new_tokens``,
        L = ``max_prompt_tokens + T``:
        ``input_ids``, ``attention_mask`` ``(B, L)``: the finished episode's observation;
        ``action``, ``sample_log_prob``, ``ref_logprob``, ``env_reward``, ``mask`` ``(B, T)`` by response
        column (observation column ``max_prompt_tokens + t``); ``mask`` is True on the policy's tokens (a
        partner's replies are observation: mask False, reward 0); ``turn_reward`` ``(B, T)`` float64, a partner's
        reward of each turn on its last token, ``turn_end`` ``(B, T)`` True there; ``kept`` ``(B, T, W)`` uint8
        when the policy returns kept sets; the final infos of :data:`FINAL_INFO_KEYS` and :data:`TURN_INFO_KEYS`
        ``(B,)``; ``prompt``, ``response`` text, and
        in a conversation its ``transcript`` (:func:`transcript`): ``td["response"]`` is a list of B str (tensordict's
        ``LinkedList``: an item set on it is written back into ``td``), ``td.get("response").tolist()`` a plain list.
    """
    _check_envs(envs)
    start = time.perf_counter()
    n, T = envs.num_envs, envs.unwrapped.max_new_tokens
    running = _start_mask(n, num_episodes)
    b = int(running.sum())
    options: dict[str, Any] = {"reset_mask": running}
    for key, given in (("prompt", prompts), ("partner_seed", partner_seeds)):
        if given is not None:
            options[key] = list(given)
    policy.reset()
    obs = _reset(envs, seed, options, reference_scoring)
    buf = _Buffers(n, T, obs["input_ids"].shape[1])
    with autocast():
        policy_seconds = _step_until_done(envs, policy, obs, running, buf)
    if timing is not None:
        timing.update(seconds=time.perf_counter() - start, policy_seconds=policy_seconds)
    return buf.tensordict(b)


def _step_until_done(envs, policy, obs: dict[str, np.ndarray], running: np.ndarray, buf: _Buffers) -> float:
    """Step every ``running`` slot until its episode ends, recording each step into ``buf``; the policy's seconds."""
    P = envs.unwrapped.max_prompt_tokens
    policy_seconds = 0.0
    while running.any():
        tp = time.perf_counter()
        actions, logps = policy.act(obs)
        policy_seconds += time.perf_counter() - tp
        actions = _as_numpy(actions).astype(np.int64)
        column = obs["attention_mask"][:, P:].sum(1)  # the response column each action is written to
        obs, reward, terminated, truncated, info = envs.step(actions)
        buf.record_kept(running, column, getattr(policy, "last_kept", None))
        buf.record_turns(running, column, info)
        ended = buf.record(running, column, actions, _as_numpy(logps), info["ref_logprob"], reward,
                           terminated | truncated)  # fmt: skip
        buf.finish(ended, obs, info)
        running &= ~ended
    return policy_seconds


def _reset(envs, seed: int | None, options: dict[str, Any], reference_scoring: str | None) -> dict[str, np.ndarray]:
    """Reset the collection's slots with π_ref scored as ``reference_scoring`` asks; the env's setting is kept.

    The setting applies to the episodes reset here (a running episode keeps its own), so it is restored at once.
    Default: ``"episode"``, ``"step"`` where ``action_masks()`` read π_ref at every step.
    """
    base = envs.unwrapped
    if reference_scoring is None:
        reference_scoring = "episode" if base.action_mask_top_p is None else "step"
    before, base.reference_scoring = base.reference_scoring, reference_scoring
    try:
        obs, _ = envs.reset(seed=seed, options=options)
    finally:
        base.reference_scoring = before
    return obs


class _Buffers:
    """Host arrays of one collection, written slot by slot as tokens and finished episodes come in.

    Per-token arrays are indexed by the token's response column, not by the step: in a conversation the
    partner's replies take columns between two of the policy's steps (mask False there).
    """

    def __init__(self, n: int, T: int, L: int):
        self.per_token = {k: np.zeros((n, T), dtype=d) for k, d in
                          (("action", np.int64), ("sample_log_prob", np.float32), ("ref_logprob", np.float32),
                           ("env_reward", np.float32))}  # fmt: skip
        self.mask = np.zeros((n, T), dtype=bool)
        # a partner's reward of each turn at the turn's last column, as the env pays it (float64: the partner's value)
        self.turn_reward = np.zeros((n, T), dtype=np.float64)
        self.turn_end = np.zeros((n, T), dtype=bool)  # True on each answered turn's last token: a 0 reward is seen
        self.obs = {k: np.zeros((n, L), dtype=np.int64) for k in ("input_ids", "attention_mask")}
        self.final = {k: np.zeros(n, dtype=d) for k, d in FINAL_INFO_KEYS.items()}
        self.final.update({k: np.full(n, default, dtype=d) for k, (d, default) in TURN_INFO_KEYS.items()})
        self.text = {k: [""] * n for k in ("prompt", "response")}
        self.transcript: list[str] | None = None  # a conversation's messages as text (TextMultiTurn-v0)
        self.kept: np.ndarray | None = None  # (n, T, W) packed kept sets of a truncating sampler

    def record_kept(self, running, column, kept) -> None:
        """Store the running slots' kept sets (None: the policy has none) at their tokens' columns."""
        if kept is None:
            return
        kept = _as_numpy(kept)
        if self.kept is None:
            self.kept = np.zeros((*self.per_token["action"].shape, kept.shape[-1]), dtype=np.uint8)
        rows = np.flatnonzero(running)
        self.kept[rows, column[rows]] = kept[rows]

    def record_turns(self, running, column, info: dict) -> None:
        """Store the partner's reward of each turn that ended on this step at the turn's last token's column.

        Why here and not from ``env_reward``: the step's reward adds β·log π_ref and, at the end, the score;
        the turn's own reward is only in the step's info (``turn_reward``, a conversation's turns only).
        """
        if "turn_reward" not in info:
            return
        rows = np.flatnonzero(running & info["_turn_reward"])
        self.turn_reward[rows, column[rows]] = info["turn_reward"][rows]
        self.turn_end[rows, column[rows]] = True

    def record(self, running, column, actions, logps, ref_logprob, reward, done) -> np.ndarray:
        """Write the step of the running slots at their tokens' columns; return the mask of those that ended."""
        rows = np.flatnonzero(running)
        t = column[rows]
        for key, values in (("action", actions), ("sample_log_prob", logps), ("ref_logprob", ref_logprob),
                            ("env_reward", reward)):  # fmt: skip
            self.per_token[key][rows, t] = values[rows]
        self.mask[rows, t] = True
        return running & done

    def finish(self, ended: np.ndarray, obs: dict, info: dict) -> None:
        """Copy the ended slots' observation, results and text; an episode scored at its end also gets each
        token's log π_ref and reward (``token_ref_logprobs``, ``token_rewards``), which its steps did not carry."""
        late = ended & info.get("_token_rewards", np.zeros_like(ended))
        for s in np.flatnonzero(late):
            self.per_token["ref_logprob"][s] = info["token_ref_logprobs"][s]
            self.per_token["env_reward"][s] = info["token_rewards"][s]
        for s in np.flatnonzero(ended):
            for key in self.obs:
                self.obs[key][s] = obs[key][s]
            for key in self.final:
                if key in FINAL_INFO_KEYS or info.get(f"_{key}", np.zeros_like(ended))[s]:
                    self.final[key][s] = info[key][s]
            for key in self.text:
                self.text[key][s] = info[key][s]
            if "conversation" in info and info["_conversation"][s]:
                self.transcript = self.transcript or [""] * len(self.mask)
                self.transcript[s] = transcript(info["conversation"][s])

    def tensordict(self, b: int) -> TensorDict:
        data = {k: torch.as_tensor(v[:b]) for k, v in {**self.per_token, **self.obs, **self.final}.items()}
        data["mask"] = torch.as_tensor(self.mask[:b])  # (B, T)
        data["turn_reward"] = torch.as_tensor(self.turn_reward[:b])  # (B, T) float64
        data["turn_end"] = torch.as_tensor(self.turn_end[:b])  # (B, T)
        if self.kept is not None:
            data["kept"] = torch.as_tensor(self.kept[:b])  # (B, T, W)
        td = TensorDict(data, batch_size=[b])
        for key, values in self.text.items():
            td[key] = NonTensorStack.from_list(values[:b])
        if self.transcript is not None:
            td["transcript"] = NonTensorStack.from_list(self.transcript[:b])
        return td


def episode_score(episodes):
    """What ``score`` means in the metrics, the evaluation and the samples: the end's score (the RM's, standardised
    when the env normalises it) plus a partner's turn rewards (0 without one). Episodes from
    :func:`collect_episodes`, or any mapping with those keys (a row of floats too)."""
    return episodes["score_reward"] + episodes["turn_reward_sum"]


def paid_score(episodes):
    """The score the env pays an episode besides β·log π_ref: :func:`episode_score` minus the missing-EOS penalty
    (``missing_eos_penalty``: 0 or the penalty). The return of an episode is ``paid_score − β·KL``."""
    return episode_score(episodes) - episodes["missing_eos_penalty"]
