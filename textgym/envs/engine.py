"""The engine behind TextRLHF-v0: N episode slots composed of five parts, stepped as prepare → commit.

- :class:`~textgym.envs.encoding.Encoding`: the tokenizer, its special ids, the chat template, the prompt block;
- :class:`~textgym.envs.layout.Layout`: the slots' observation rows, lengths and the policy's columns;
- :class:`~textgym.envs.reference.Reference`: π_ref, its cached decoder, step and episode scoring, top-p masks;
- :class:`~textgym.envs.reward.Rewards`: the reward models and the one reward formula;
- a :class:`~textgym.envs.dialogue.Dialogue`: :class:`~textgym.envs.dialogue.OneTurn` or a
  :class:`~textgym.envs.turns.Conversation` with partners.

The single env is one slot of it, the native vector env N: each step is one batched, cached π_ref
forward over every slot and one batched reward-model call for the episodes ending on it. A step is
prepared (every part answers: π_ref's log-probs, the partners, the scorers; nothing written) and then
committed (π_ref's decoder step, the one write that can fail, restores its cache if it does; then plain
writes): a failure anywhere leaves the env as it was, with no hand-written rollback.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

# Import the Llama classes the embedded models use now, not inside gym.make (≈3 s of imports).
from transformers.models.llama import modeling_llama  # noqa: F401

from textgym.envs.checks import (
    DEFAULT_KL_COEF,
    check_int,
    check_kl_coef,
    check_nonnegative,
    check_positions,
    check_timeout,
)
from textgym.envs.dialogue import Answers, Dialogue, OneTurn
from textgym.envs.encoding import Encoding, opening_margin
from textgym.envs.layout import Layout, Move
from textgym.envs.prompts import load_prompts
from textgym.envs.reference import REFERENCE_SCORING, Prefill, Reference, check_reference_scoring, own_dtypes
from textgym.envs.reward import load_scorers, reward
from textgym.envs.turns import Conversation, ReplyTemplate
from textgym.errors import short_repr
from textgym.memory import exceeded, kv_cache_bytes, kv_width
from textgym.models import load_causal_lm, resolve_device
from textgym.rewards import Episodes
from textgym.threads import apply_default_threads

__all__ = ["DEFAULT_KL_COEF", "REFERENCE_SCORING", "Engine", "check_reference_scoring", "opening_margin"]

# what fits a game's opening (185-1100 tokens) where the embedded LM's 128 positions do not
LONGER_MODEL = "a model with more positions fits it, e.g. model='smollm2-135m-instruct' (8192) with chat_template=True"

apply_default_threads()  # torch is loaded now: every core under textgym's wait, one fewer if torch came first
_IMPORT_PID = os.getpid()  # a process whose pid differs was forked after this module was imported


@dataclasses.dataclass(frozen=True)
class PreparedStart:
    """A start computed and checked, nothing written yet (:meth:`Engine.prepare_start`)."""

    slots: list[int]
    prompts: list[str]  # the texts the episodes start from (a partner's opening in place of the drawn prompt)
    seeds: list[int] | None  # the partners' seeds (None: no partner)
    prefill: Prefill  # the prompt blocks and π_ref's prefill forward


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    """A step computed, nothing written yet (:meth:`Engine.prepare_step`): what :meth:`Engine.commit_step` writes
    and what it returns (the (N,) arrays and the per-slot infos)."""

    move: Move  # the live slots' actions
    fed: np.ndarray  # (N,) the slots whose action π_ref's decoder reads (stepped and not ended)
    actions: np.ndarray  # (N,)
    answers: Answers  # the turns that ended, their replies
    out: dict[str, Any]  # reward, terminated, truncated, ref_logprob, final, turn


def slot_bytes(vocab: int, layers: int, kv_width: int, itemsize: int, seq_len: int, max_new_tokens: int,
               cached: bool) -> int:  # fmt: skip
    """A lower bound of one env slot's memory, in bytes.

    π_ref's next-token logits (V float32); its KV cache when it scores step by step (K and V of every layer,
    ``seq_len + 1`` ring columns, π_ref's dtype); the observation (ids and mask, int64) and a conversation's
    per-column arrays (policy mask, turn reward). The model and the reward models come on top.
    """
    kv = kv_cache_bytes(layers, kv_width, seq_len + 1, itemsize) if cached else 0
    return vocab * 4 + kv + 2 * seq_len * 8 + max_new_tokens * 9


def _fork_safe_threads() -> None:
    """Run torch on one thread in a process forked after textgym was imported.

    Why: GNU OpenMP's thread pool does not survive ``fork``. Once the parent has run a parallel torch
    op, the child's first one waits forever for threads that exist only in the parent (Gymnasium's
    ``AsyncVectorEnv`` forks by default). With one thread torch never enters an OpenMP region; it is
    also what N worker processes on N cores want, and what torch's own DataLoader workers do.
    """
    if os.getpid() != _IMPORT_PID:
        torch.set_num_threads(1)


def _check_turn_arguments(partner, max_turns, max_turn_tokens, partner_timeout) -> None:
    """The turn arguments belong to a conversation: given without ``partner``, they would be ignored."""
    if partner is None:
        for name, value in (("max_turns", max_turns), ("max_turn_tokens", max_turn_tokens),
                            ("partner_timeout", partner_timeout)):  # fmt: skip
            if value is not None:
                raise ValueError(f"{name}={value!r} needs partner=...: an episode without a partner is one turn")


def _check_top_p(action_mask_top_p: float | None) -> float | None:
    """``action_mask_top_p``: a probability mass in (0, 1], or None for no action mask."""
    if action_mask_top_p is not None and not (
        isinstance(action_mask_top_p, (int, float)) and 0 < action_mask_top_p <= 1
    ):
        raise ValueError(f"action_mask_top_p={action_mask_top_p!r} must be a float in (0, 1] or None")
    return action_mask_top_p


def check_slots_fit(model, vocab: int, num_slots: int, seq_len: int, max_new_tokens: int, scoring: str) -> None:
    """Refuse ``num_slots`` slots whose arrays and caches would not fit in memory, naming how many would.

    Raises:
        ValueError: naming ``num_envs``, the bytes per slot, the memory they exceed and the slots that fit.
    """
    itemsize = next(model.parameters()).element_size()
    cached = scoring == "step"
    per_slot = slot_bytes(vocab, model.config.num_hidden_layers, kv_width(model.config), itemsize, seq_len,
                          max_new_tokens, cached)  # fmt: skip
    over = exceeded(num_slots * per_slot)
    if over is not None:
        raise ValueError(
            f"num_envs={num_slots} needs at least {num_slots * per_slot / 2**30:.2f} GiB for the env's slots "
            f"({per_slot / 2**20:.3f} MiB each: π_ref's next-token logits over {vocab} tokens"
            f"{', its KV cache of ' + str(seq_len + 1) + ' columns' if cached else ''} and the observations), "
            f"more than {over[0]}; at most {over[1] // per_slot} slots fit"
        )


def check_prompt_room(model, encoding: Encoding, max_new_tokens: int) -> None:
    """Refuse a prompt that leaves no room for the response in the model's positions, naming the prompt.

    Why here and not in :func:`~textgym.envs.checks.check_positions` alone: when the longest prompt
    fills every position, that check's bound on max_new_tokens is negative and points at the wrong
    argument.
    """
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    (name, text), longest = encoding.longest
    block = encoding.block
    if isinstance(limit, int) and block >= limit:  # not even one response token fits
        sized = "" if block == longest else f" (with room for other seeds' openings, a block of {block})"
        raise ValueError(
            f"{name}={short_repr(text)} is {longest} tokens{sized}; model has {limit} positions, so "
            f"with max_new_tokens={max_new_tokens} a prompt may be at most {limit - max_new_tokens} tokens "
            f"(prompts are never truncated); {LONGER_MODEL}"
        )


class Engine:
    """The parts of N episode slots and the step over them: what the single and vector env share (module docstring)."""

    def __init__(
        self,
        num_slots: int,
        model=None,
        tokenizer=None,
        reward_model=None,
        gold_scorer="vader",
        prompts=None,
        prompt_column: str = "prompt",
        max_prompt_tokens: int | None = None,
        max_new_tokens: int = 32,
        kl_coef: float = DEFAULT_KL_COEF,
        normalize_reward: bool | tuple[float, float] | None = None,
        missing_eos_penalty: float = 0.0,
        action_mask_top_p: float | None = None,
        stop_token_ids: Sequence[int] | None = None,
        chat_template: bool = False,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = None,
        reward_timeout: float | None = None,
        reference_scoring: str = "step",
        partner=None,
        max_turns: int | None = None,
        max_turn_tokens: int | None = None,
        partner_timeout: float | None = None,
    ):
        _fork_safe_threads()
        # the plain arguments first: a bad number is reported before any model is loaded
        T = self.max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
        self.action_mask_top_p = _check_top_p(action_mask_top_p)
        missing_eos_penalty = check_nonnegative("missing_eos_penalty", missing_eos_penalty)
        if max_prompt_tokens is not None:
            max_prompt_tokens = check_int("max_prompt_tokens", max_prompt_tokens, 1)
        reward_timeout = check_timeout(reward_timeout)
        scoring = check_reference_scoring(reference_scoring)
        kl_coef = check_kl_coef(kl_coef)
        self.device = resolve_device(device)
        _check_turn_arguments(partner, max_turns, max_turn_tokens, partner_timeout)
        self.model = load_causal_lm(model, self.device, dtype, name="model")
        enc = self.encoding = Encoding(self.model, model, tokenizer, stop_token_ids, chat_template)
        # before N partners are made, then again with the prompt block's width
        check_slots_fit(self.model, enc.vocab_size, num_slots, (max_prompt_tokens or 1) + T, T, scoring)
        self.prompts = load_prompts(prompts, prompt_column)
        self.dialogue: Dialogue = OneTurn(T) if partner is None else Conversation(
            partner, num_slots, T, ReplyTemplate(enc.tokenizer, enc.chat_template, enc.stop_ids),
            max_turns, max_turn_tokens, partner_timeout,
        )  # fmt: skip
        probed = self.dialogue.probe(self.prompts[0])  # a partner may open with its own text (a game's rules)
        texts = [(f"prompts[{i}]", p) for i, p in enumerate(self.prompts)] + probed
        P = self.max_prompt_tokens = enc.size_block(texts, len(probed), max_prompt_tokens)
        self.seq_len = P + T
        check_prompt_room(self.model, enc, T)
        check_positions("model", self.model, self.seq_len, P, T)
        self.rewards = load_scorers(reward_model, gold_scorer, normalize_reward, optional=self.dialogue.has_partner,
                                    device=self.device, tokenizer=enc.tokenizer, reference=self.model, shape=(P, T),
                                    timeout=reward_timeout, missing_eos_penalty=missing_eos_penalty)  # fmt: skip
        self.rewards.kl_coef, self.num_slots = kl_coef, num_slots
        check_slots_fit(self.model, enc.vocab_size, num_slots, self.seq_len, T, scoring)
        self.layout = Layout(num_slots, P, T, enc.pad_id)
        self.reference = Reference(self.model, num_slots, self.seq_len, enc.vocab_size, scoring, self.device)

    vocab_size = property(lambda self: self.encoding.vocab_size)
    tokenizer = property(lambda self: self.encoding.tokenizer)
    reward_model = property(lambda self: self.rewards.reward_model)
    gold_scorer = property(lambda self: self.rewards.gold_scorer)
    norm = property(lambda self: self.rewards.norm, doc="(mean, std, ...) the RM's score is standardised by, or None")
    decoder = property(lambda self: self.reference.decoder)
    started = property(lambda self: self.layout.started)
    done = property(lambda self: self.layout.done)
    deferred = property(lambda self: self.reference.deferred)
    prompt_text = property(lambda self: self.layout.prompt_text)

    @property
    def kl_coef(self) -> float:
        return self.rewards.kl_coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self.rewards.kl_coef = value

    @property
    def reference_scoring(self) -> str:
        """``"step"`` or ``"episode"``: how episodes started from now on get log π_ref (a running one keeps its own)."""
        return self.reference.scoring

    @reference_scoring.setter
    def reference_scoring(self, value: str) -> None:
        self.reference.scoring = check_reference_scoring(value)

    def encode_prompts(self, prompts: Sequence[str], names: Sequence[str] | None = None) -> list[list[int]]:
        """Token ids of ``prompts``, each checked to fit in ``max_prompt_tokens`` (:meth:`Encoding.encode_prompts`)."""
        return self.encoding.encode_prompts(prompts, names)

    def observation(self, slots) -> dict[str, np.ndarray]:
        return self.layout.observation(slots)

    def start(self, slots: list[int], prompts: list[str], encoded: list[list[int]] | None = None,
              partner_seeds: Sequence[int] | None = None) -> None:  # fmt: skip
        """Begin episodes on ``slots``: write the prompts and prefill π_ref's cache with them.

        ``encoded`` is ``encode_prompts(prompts)`` when the caller has already checked them. With a
        partner, each slot's partner is reset with its seed (``partner_seeds``, one per slot) and may
        replace the prompt with its own opening. A refused or failed start leaves the slots as they were.
        """
        self.commit_start(self.prepare_start(slots, prompts, encoded, partner_seeds))

    def prepare_start(self, slots: list[int], prompts: list[str], encoded: list[list[int]] | None = None,
                      partner_seeds: Sequence[int] | None = None) -> PreparedStart:  # fmt: skip
        """Everything a start needs, nothing of the slots written: the openings (the partners' resets), the
        checked encodings, the prompt block and π_ref's prefill forward. A vector env's step prepares its
        autoresets beside the step, so a failing reset leaves the whole step undone."""
        seeds = None if partner_seeds is None else [int(x) for x in partner_seeds]
        opened = self.dialogue.openings(slots, list(prompts), seeds)
        if opened is not None:  # an opening is checked like a given prompt, named by its seed
            prompts = opened
            names = [f"the partner's opening for seed {seed}" for seed in (seeds or [0] * len(slots))]
            encoded = self.encoding.encode_prompts(prompts, names)
        if encoded is None:
            encoded = self.encoding.encode_prompts(prompts)
        enc = self.encoding
        prefill = self.reference.prepare(encoded, self.max_prompt_tokens, enc.tokenizer, enc.pad_id)
        return PreparedStart(list(slots), list(prompts), seeds, prefill)

    def commit_start(self, start: PreparedStart) -> None:
        """Write a :meth:`prepare_start`: the prompt blocks, π_ref's cache rows and next-token logits, the flags."""
        self.reference.commit(start.slots, start.prefill)
        self.layout.start(start.slots, start.prefill.block_ids, start.prefill.block_mask, start.prompts)
        self.dialogue.begin(start.slots, start.prompts, start.seeds)

    def advance(self, actions: np.ndarray, live: np.ndarray) -> dict[str, Any]:
        """Apply ``actions`` to the ``live`` slots: :meth:`prepare_step`, then :meth:`commit_step`."""
        return self.commit_step(self.prepare_step(actions, live))

    def prepare_step(self, actions: np.ndarray, live: np.ndarray) -> PreparedStep:
        """Everything the step of the ``live`` slots computes, nothing written: log π_ref of the actions, the turns
        that end and the partners' answers, the scores of the episodes that end. One batched RM call.

        Its ``out`` is what :meth:`commit_step` returns: (N,) arrays reward, terminated, truncated, ref_logprob;
        ``final``, a {slot: info} dict for the episodes that end on this step; and ``turn``, a {slot: info} dict
        for the slots whose turn ends on it (``turn_reward``, the partner's ``reply``; multi-turn only).
        """
        self.reference.refresh(self.layout)
        n, T, d = len(actions), self.max_new_tokens, self.dialogue
        idx = np.flatnonzero(live)
        stepped = live & ~self.reference.deferred  # slots whose log π_ref is read now from the cached logits
        ref_lp = self.reference.logprobs(stepped, actions)
        ref_lp[live & self.reference.deferred] = np.nan  # known at the episode's end (info["ref_logprobs"])
        move, length = Move(idx, actions[idx]), self.layout.length[idx] + 1  # response columns used after it
        stopped, turn_over, capped = (np.zeros(n, dtype=bool) for _ in range(3))
        stopped[idx] = np.isin(actions[idx], self.encoding.stop_array)
        turn_over[idx] = d.turn_over(idx, stopped[idx], length)
        # The length cap is a terminal state of this MDP, not an outside time limit: the observation
        # encodes the step and the score is paid there. `truncated` would make SB3 & co. bootstrap
        # γ·V(s_T) on top of the score. `truncated` stays False: it is for users' TimeLimit wrappers.
        capped[idx] = ~turn_over[idx] & (length >= T)
        rows = self.layout.rows(idx[(turn_over | capped)[idx]], move)  # the turns that end, as the step leaves them
        texts = {int(s): self.encoding.text(rows.response_ids(k, d.turn_start(s))) for k, s in enumerate(rows.slots)}
        ending = idx[turn_over[idx]]
        answers = d.answer(ending, [texts[int(s)] for s in ending], actions[ending], length[turn_over[idx]], T)
        ended, turn = capped.copy(), np.zeros(n)
        ended[ending], turn[ending] = answers.over, answers.rewards
        end, late_kl, final = np.zeros(n), np.zeros(n), {}
        if ended.any():
            with own_dtypes(self.device):  # the reward models and π_ref in their own dtypes
                final = self._finish(rows, ended, capped, texts, answers, end, late_kl)
        kl = np.where(stepped, self.kl_coef * ref_lp, 0.0)
        out = {"reward": reward(kl, turn, end, late_kl), "terminated": ended, "truncated": np.zeros(n, dtype=bool),
               "ref_logprob": ref_lp, "final": final, "turn": answers.infos}  # fmt: skip
        return PreparedStep(move, stepped & ~ended, actions, answers, out)

    def commit_step(self, step: PreparedStep) -> dict[str, Any]:
        """Write a :meth:`prepare_step`. π_ref's decoder step comes first: it is the one write that can fail, and
        it restores its cache when it does, so nothing of the step is written then."""
        self.reference.step(step.fed, step.actions, self.encoding.eos_id)
        self.layout.apply(step.move)
        self.layout.done |= step.out["terminated"]
        self.dialogue.commit(step.answers)
        for s, ids in step.answers.replies.items():  # the partners' replies become observation: never the policy's
            self.layout.append_reply(s, ids)
            self.reference.stale[s] = True
        return step.out

    def _finish(self, rows, ended, capped, texts, answers, end, late_kl) -> dict[int, dict]:
        """Score the episodes ending now (one batched call per scorer) into ``end`` (score − penalty) and, for
        those π_ref scores at their end, ``late_kl`` (β·Σ log π_ref); their final infos by slot."""
        rows = rows.subset(ended[rows.slots])
        slots = [int(s) for s in rows.slots]
        episodes = Episodes(prompts=[self.layout.prompt_text[s] for s in slots], responses=[texts[s] for s in slots],
                            prompt_ids=[self.layout.prompt_ids(s) for s in slots],
                            response_ids=[rows.response_ids(k, self.dialogue.turn_start(s))
                                          for k, s in enumerate(slots)])  # fmt: skip
        rm, score, gold = self.rewards.scores(episodes, slots if self.num_slots > 1 else None)
        verdicts = self.rewards.verdicts(episodes)  # None: the reward model judges nothing
        late = self.reference.episodes(rows.subset(self.reference.deferred[rows.slots]))  # {slot: (length,)}
        final = {}
        for k, s in enumerate(slots):
            penalty = self.rewards.penalty(capped[s])
            end[s] = score[k] - penalty
            summary = self.dialogue.summary(s, answers, bool(capped[s]), texts[s], int(rows.length[k]))
            extra = dict(summary.infos)
            if s in late:  # the whole episode's β·Σ_t log π_ref is paid here, and each token's part is named
                ref_lp = late[s] * rows.policy_columns(k)  # the partner's tokens are observation: no KL on them
                extra.update(self.rewards.token_infos(ref_lp, summary.turn_rewards, end[s], self.max_new_tokens))
                late_kl[s] = self.kl_coef * ref_lp.sum()
            # numpy scalars: TorchRL's info readers need a dtype (a float64 is also a Python float)
            final[s] = {
                "rm_score": np.float64(rm[k]),
                "score_reward": np.float64(score[k]),
                "missing_eos_penalty": np.float64(penalty),  # what was subtracted: the setting's sign
                "eos_penalty": np.float64(-penalty),  # deprecated (issue 43): −missing_eos_penalty, for one version
                "gold_score": np.float64(summary.gold if gold is None else gold[k]),
                # the task's own verdict (1.0 solved / won, 0.0 not, NaN: the task has none): the partner's, else
                # the reward model's
                "verdict": np.float64(
                    summary.verdict if verdicts is None or not np.isnan(summary.verdict) else verdicts[k]
                ),  # fmt: skip
                "prompt": episodes.prompts[k],
                "response": episodes.responses[k],
                "response_length": np.int64(rows.policy_columns(k).sum()),
                "length_capped": np.bool_(capped[s]),
                **extra,
            }
        return final

    def close(self) -> None:
        """Close the dialogue's partners (once; a closed engine steps no more)."""
        self.dialogue.close()

    def action_masks(self) -> np.ndarray:
        """``(N, V)`` bool: π_ref's top-p tokens at each slot's state (all True without ``action_mask_top_p``)."""
        return self.reference.top_p_masks(self.action_mask_top_p, self.layout)

    def response_text(self, slot: int) -> str:
        return self.encoding.text(self.layout.response_ids(slot))

    def render(self, slot: int) -> str:
        return self.layout.prompt_text[slot] + self.response_text(slot)
