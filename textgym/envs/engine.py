"""The engine behind TextRLHF-v0: π_ref's KV-cached forwards, the reward models and N episode slots.

The single env is one slot of it, the native vector env N: each step is one batched, cached π_ref
forward over every slot and one batched reward-model call for the episodes ending on it.
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
    check_chat_template,
    check_int,
    check_kl_coef,
    check_nonnegative,
    check_norm_reference,
    check_positions,
    check_timeout,
    check_vocabulary,
    resolve_norm,
    resolve_stop_ids,
)
from textgym.envs.prompts import load_prompts
from textgym.envs.turns import ReplyTemplate, Turns
from textgym.memory import exceeded, kv_cache_bytes, kv_width
from textgym.models import (
    context_rows,
    left_pad,
    load_causal_lm,
    load_tokenizer,
    pad_id_for,
    resolve_device,
)
from textgym.rewards import Episodes, make_reward_model, score_checked
from textgym.ring_decoder import make_decoder
from textgym.threads import apply_default_threads
from textgym.token_logprobs import policy_logprobs
from textgym.utils import short_repr

__all__ = ["DEFAULT_KL_COEF", "REFERENCE_SCORING", "Engine"]

# When π_ref scores a token: at its step (a cached forward per step, Gymnasium's per-step reward) or
# once the episode ends (one teacher-forced forward over the finished episodes; what the collectors use)
REFERENCE_SCORING = ("step", "episode")
_TEACHER_FORCED_ROWS = 64  # episodes per teacher-forced forward: bounds the body's activations (the head is chunked)
_PROBED_OPENINGS = 4  # partner seeds whose openings size the prompt block when max_prompt_tokens is not given


# what fits a game's opening (185-1100 tokens) where the embedded LM's 128 positions do not
LONGER_MODEL = "a model with more positions fits it, e.g. model='smollm2-135m-instruct' (8192) with chat_template=True"


def opening_margin(longest: int) -> int:
    """Columns the prompt block keeps beyond the longest probed opening: max(16, 1/8 of it).

    Why: a game's opening varies with the seed (a board, a hand, a word list) and episodes draw seeds
    below 2**30; probing them all is out of reach (RushHour resets in 0.47 s). Over seeds 0-199 with
    SmolLM2's chat template the longest opening of each offline TextArena game exceeded the longest of
    seeds 0-3 by at most 12 tokens (1.3 %; docs/multi-turn.md): the margin covers 4x that.
    """
    return max(16, longest // 8)


apply_default_threads()  # torch is loaded now: every core under textgym's wait, one fewer if torch came first
_IMPORT_PID = os.getpid()  # a process whose pid differs was forked after this module was imported


@dataclasses.dataclass
class PreparedStart:
    """A start computed and checked, nothing written yet (:meth:`Engine.prepare_start`)."""

    slots: list[int]
    prompts: list[str]  # the texts the episodes start from (a partner's opening in place of the drawn prompt)
    seeds: list[int] | None  # the partners' seeds (None: no partner)
    block_ids: np.ndarray  # (k, P) the left-padded prompt block
    block_mask: np.ndarray  # (k, P)
    deferred: bool  # π_ref scores these episodes at their end
    prefill: tuple | None  # (π_ref's prefill forward, its mask) in step mode


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


def check_reference_scoring(reference_scoring: str) -> str:
    """``reference_scoring``: one of :data:`REFERENCE_SCORING`."""
    if reference_scoring not in REFERENCE_SCORING:
        raise ValueError(f"reference_scoring={reference_scoring!r} is not one of {REFERENCE_SCORING}")
    return reference_scoring


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


class Engine:
    """Models, prompts and the episode state of N slots: what the single and vector env share.

    Observation layout of a slot, length ``L = max_prompt_tokens + max_new_tokens``::

        [PAD … PAD, prompt tokens][response tokens, PAD … PAD]
        |<---- max_prompt_tokens ->|<------- max_new_tokens ----->|

    The prompt is left-padded into the first block so that response token k always sits at
    column ``max_prompt_tokens + k``; ``attention_mask`` marks the real tokens.
    """

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
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
        self.action_mask_top_p = _check_top_p(action_mask_top_p)
        missing_eos_penalty = check_nonnegative("missing_eos_penalty", missing_eos_penalty)
        if max_prompt_tokens is not None:
            max_prompt_tokens = check_int("max_prompt_tokens", max_prompt_tokens, 1)
        self.reward_timeout = check_timeout(reward_timeout)
        self.reference_scoring = reference_scoring
        self.device = resolve_device(device)
        self.kl_coef = kl_coef
        _check_turn_arguments(partner, max_turns, max_turn_tokens, partner_timeout)
        self._load_reference(model, tokenizer, dtype, stop_token_ids, chat_template)
        self._check_slots_fit(num_slots, (max_prompt_tokens or 1) + max_new_tokens, max_new_tokens)  # before N partners
        self.prompts = load_prompts(prompts, prompt_column)
        self.turns = None if partner is None else Turns(
            partner, num_slots, max_new_tokens, ReplyTemplate(self.tokenizer, self.chat_template, self.stop_ids),
            max_turns, max_turn_tokens, partner_timeout,
        )  # fmt: skip
        self.max_prompt_tokens = self._prompt_block(max_prompt_tokens)
        self.max_new_tokens = max_new_tokens
        self.seq_len = self.max_prompt_tokens + self.max_new_tokens
        self._check_prompt_room(max_new_tokens)
        check_positions("model", self.model, self.seq_len, self.max_prompt_tokens, max_new_tokens)
        self._load_scorers(reward_model, gold_scorer, normalize_reward)
        self.missing_eos_penalty = missing_eos_penalty
        self._check_slots_fit(num_slots, self.seq_len, max_new_tokens)  # now with the prompt block's width
        self._allocate_slots(num_slots)

    def _check_slots_fit(self, num_slots: int, seq_len: int, max_new_tokens: int) -> None:
        """Refuse ``num_slots`` slots whose arrays and caches would not fit in memory, naming how many would.

        Raises:
            ValueError: naming ``num_envs``, the bytes per slot, the memory they exceed and the slots that fit.
        """
        config = self.model.config
        itemsize = next(self.model.parameters()).element_size()
        cached = self.reference_scoring == "step"
        per_slot = slot_bytes(self.vocab_size, config.num_hidden_layers, kv_width(config), itemsize, seq_len,
                              max_new_tokens, cached)  # fmt: skip
        over = exceeded(num_slots * per_slot)
        if over is not None:
            raise ValueError(
                f"num_envs={num_slots} needs at least {num_slots * per_slot / 2**30:.2f} GiB for the env's slots "
                f"({per_slot / 2**20:.3f} MiB each: π_ref's next-token logits over {self.vocab_size} tokens"
                f"{', its KV cache of ' + str(seq_len + 1) + ' columns' if cached else ''} and the observations), "
                f"more than {over[0]}; at most {over[1] // per_slot} slots fit"
            )

    def _load_reference(self, model, tokenizer, dtype, stop_token_ids, chat_template: bool) -> None:
        """π_ref and its tokenizer, and the token ids the episodes need from them (EOS, stops, PAD, BOS).

        Loaded before the prompts: encoding a prompt needs the tokenizer, its BOS and the chat template.
        """
        self.model = load_causal_lm(model, self.device, dtype, name="model")
        # without tokenizer= the model's folder must hold one: the error then names model=
        tok_arg = ("tokenizer", tokenizer) if tokenizer is not None else ("model", model)
        self.tokenizer = load_tokenizer(tok_arg[1], name=tok_arg[0])
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        check_vocabulary(model, self.vocab_size, self.tokenizer)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.stop_ids = resolve_stop_ids(self.model, self.tokenizer, stop_token_ids, self.vocab_size)
        self.stop_array = np.array(sorted(self.stop_ids), dtype=np.int64)
        self.pad_id = pad_id_for(self.tokenizer, self.stop_ids)
        if self.tokenizer.pad_token_id is None:  # GPT-2 style: pad through the tokenizer with our PAD
            self.tokenizer.pad_token = self.tokenizer.convert_ids_to_tokens(self.pad_id)
        self.chat_template = check_chat_template(chat_template, self.tokenizer)
        self.bos_id = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eos_id

    def _load_scorers(self, reward_model, gold_scorer, normalize_reward) -> None:
        """The reward model, the gold scorer and the reward normalisation.

        Loaded once the observation width is known: a reward model sharing the tokenizer must have
        positions for a whole episode, and its stored normalisation is checked against ``max_new_tokens``.
        """
        if reward_model is None and self.turns is not None:  # a conversation's rewards may all be the partner's
            self.reward_model = None
        else:
            self.reward_model = self._bind(make_reward_model(reward_model, "reward_model", device=self.device))
        if getattr(self.reward_model, "shares_tokenizer", False) and hasattr(self.reward_model, "model"):
            # it scores prompt + response + the EOS closing a length-capped response
            check_positions("reward_model", self.reward_model.model, self.seq_len + 1, self.max_prompt_tokens,
                             self.max_new_tokens)  # fmt: skip
        self.gold_scorer = None if gold_scorer is None else self._bind(make_reward_model(gold_scorer, "gold_scorer"))
        self.norm = resolve_norm(normalize_reward, self.reward_model, self.max_new_tokens, timeout=self.reward_timeout)
        check_norm_reference(normalize_reward, self.norm, self.reward_model, self.model)

    def _allocate_slots(self, num_slots: int) -> None:
        """Every slot's episode state, sized once for ``num_slots`` × ``seq_len``: ``start`` and ``advance`` fill it."""
        self.num_slots = num_slots
        n, L = num_slots, self.seq_len
        self.decoder = make_decoder("auto", self.model, n, L)  # the ring: a decode step of fixed shapes
        self.input_ids = np.full((n, L), self.pad_id, dtype=np.int64)
        self.attention_mask = np.zeros((n, L), dtype=np.int64)
        self.length = np.zeros(n, dtype=np.int64)  # response tokens so far
        self.started = np.zeros(n, dtype=bool)
        self.done = np.zeros(n, dtype=bool)
        self.deferred = np.zeros(n, dtype=bool)  # π_ref scores the slot's episode at its end (reference_scoring)
        self.stale = np.zeros(n, dtype=bool)  # a reply was added: π_ref's cache re-reads the conversation (step mode)
        self.prompt_text: list[str] = [""] * n
        # π_ref's next-token logits and their log-sum-exp: log π_ref(a|s_t) = logit[a] − lse, one gather
        self.next_logits = torch.zeros(n, self.vocab_size, device=self.device)  # (N, V)
        self.next_lse = torch.zeros(n, device=self.device)  # (N,)

    def _bind(self, rm):
        if hasattr(rm, "bind"):
            rm.bind(self.tokenizer)
        return rm

    def _prompt_block(self, max_prompt_tokens: int | None) -> int:
        """The prompt block's width: the longest prompt of the set, or the width given if every prompt fits."""
        texts = [(f"prompts[{i}]", p) for i, p in enumerate(self.prompts)]
        if self.turns is not None:  # a partner may open with its own text (a game's rules): a few seeds' openings
            seeds = list(range(_PROBED_OPENINGS))
            openings = self.turns.openings([0] * len(seeds), [self.prompts[0]] * len(seeds), seeds)
            texts += [(f"the partner's opening for seed {k}", p) for k, p in enumerate(openings)
                      if p != self.prompts[0]]  # fmt: skip
        encoded = [self.encode_prompt(p) for _, p in texts]
        longest = max(len(e) for e in encoded)
        width = longest if max_prompt_tokens is None else max_prompt_tokens
        if max_prompt_tokens is None and len(texts) > len(self.prompts):  # openings: room for other seeds' ones
            width = longest + opening_margin(longest)
        i = max(range(len(encoded)), key=lambda j: len(encoded[j]))
        self.longest_prompt = (texts[i], longest)  # named by _check_prompt_room
        if longest > width:
            raise ValueError(
                f"{texts[i][0]}={short_repr(texts[i][1])} is {longest} tokens, more than "
                f"max_prompt_tokens={width}; prompts are never truncated"
            )
        return width

    def _check_prompt_room(self, max_new_tokens: int) -> None:
        """Refuse a prompt that leaves no room for the response in the model's positions, naming the prompt.

        Why here and not in :func:`~textgym.envs.checks.check_positions` alone: when the longest prompt
        fills every position, that check's bound on max_new_tokens is negative and points at the wrong
        argument.
        """
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        (name, text), longest = self.longest_prompt
        block = self.max_prompt_tokens
        if isinstance(limit, int) and block >= limit:  # not even one response token fits
            sized = "" if block == longest else f" (with room for other seeds' openings, a block of {block})"
            raise ValueError(
                f"{name}={short_repr(text)} is {longest} tokens{sized}; model has {limit} positions, so "
                f"with max_new_tokens={max_new_tokens} a prompt may be at most {limit - max_new_tokens} tokens "
                f"(prompts are never truncated); {LONGER_MODEL}"
            )

    @property
    def reference_scoring(self) -> str:
        """``"step"`` or ``"episode"``: how episodes started from now on get log π_ref (a running one keeps its own)."""
        return self._reference_scoring

    @reference_scoring.setter
    def reference_scoring(self, value: str) -> None:
        self._reference_scoring = check_reference_scoring(value)

    @property
    def kl_coef(self) -> float:
        return self._kl_coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self._kl_coef = check_kl_coef(value)

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids fed to π_ref: the tokenizer's encoding; BOS alone for an empty prompt.

        With ``chat_template`` the prompt is the user turn of the tokenizer's chat template,
        followed by the assistant's generation prompt (the template writes its own special tokens).
        Special-token text in a prompt (``"The <pad> movie"``) is encoded as text, never as the
        special token: a prompt must not put a PAD or EOS id under mask 1.
        """
        if not isinstance(prompt, str):
            raise TypeError(f"prompt={short_repr(prompt)} is not a str; give a str (the empty prompt starts from BOS)")
        if self.chat_template:
            # tokenized with add_special_tokens=False (the template writes them); the user's text stays text
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False,
                sanitize_control_tokens=True,
            )  # fmt: skip
        ids = self.tokenizer(prompt, split_special_tokens=True)["input_ids"] if prompt else []
        return ids if ids else [self.bos_id]

    def observation(self, slots) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids[slots].copy(), "attention_mask": self.attention_mask[slots].copy()}

    def encode_prompts(self, prompts: Sequence[str], names: Sequence[str] | None = None) -> list[list[int]]:
        """Token ids of ``prompts``, each checked to fit in ``max_prompt_tokens`` (never truncated).

        ``names``: what each prompt is, for the error (default ``prompt``; a partner's opening names its seed).

        Raises:
            TypeError: a prompt is not a str.
            ValueError: a prompt is longer than ``max_prompt_tokens``.
        """
        encoded = [self.encode_prompt(p) for p in prompts]
        for k, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
            if len(ids) > self.max_prompt_tokens:
                raise ValueError(
                    f"{'prompt' if names is None else names[k]}={short_repr(p)} is {len(ids)} tokens, more than "
                    f"max_prompt_tokens={self.max_prompt_tokens}; prompts are never truncated: give a shorter one "
                    f"or build the env with max_prompt_tokens >= {len(ids)} (textgym train --max-prompt-tokens)"
                )
        return encoded

    def start(self, slots: list[int], prompts: list[str], encoded: list[list[int]] | None = None,
              partner_seeds: Sequence[int] | None = None) -> None:  # fmt: skip
        """Begin episodes on ``slots``: write the prompts and prefill π_ref's cache with them.

        ``encoded`` is ``encode_prompts(prompts)`` when the caller has already checked them. With a
        partner, each slot's partner is reset with its seed (``partner_seeds``, one per slot) and may
        replace the prompt with its own opening. A refused or failed start leaves the slots as they were:
        :meth:`prepare_start` computes everything, :meth:`commit_start` only writes.
        """
        self.commit_start(self.prepare_start(slots, prompts, encoded, partner_seeds))

    def prepare_start(self, slots: list[int], prompts: list[str], encoded: list[list[int]] | None = None,
                      partner_seeds: Sequence[int] | None = None) -> PreparedStart:  # fmt: skip
        """Everything a start needs, nothing of the slots written: the openings (the partners' resets), the
        checked encodings, the prompt block and π_ref's prefill forward. A vector env's step prepares its
        autoresets before it advances the live slots, so a failing reset leaves the whole step undone."""
        seeds = None
        if self.turns is not None:
            seeds = [0] * len(slots) if partner_seeds is None else [int(x) for x in partner_seeds]
            prompts = self.turns.openings(slots, prompts, seeds)
            names = [f"the partner's opening for seed {seed}" for seed in seeds]
            encoded = self.encode_prompts(prompts, names)  # an opening is checked like a given prompt
        if encoded is None:
            encoded = self.encode_prompts(prompts)
        P = self.max_prompt_tokens
        block_ids, block_mask = left_pad(self.tokenizer, encoded, P, "np", self.pad_id)  # (k, P)
        deferred = self.reference_scoring == "episode"
        prefill = None
        if not deferred:  # an episode scored at its end needs no cache: π_ref reads it whole then
            width = max(len(e) for e in encoded)  # π_ref prefills only the columns some prompt uses
            mask = torch.as_tensor(block_mask[:, P - width :], device=self.device)
            with self._reference_forward():
                out = self.decoder.forward_prefill(torch.as_tensor(block_ids[:, P - width :], device=self.device), mask)
            prefill = (out, mask)
        return PreparedStart(list(slots), list(prompts), seeds, block_ids, block_mask, deferred, prefill)

    def commit_start(self, start: PreparedStart) -> None:
        """Write a :meth:`prepare_start`: the prompt blocks, π_ref's cache rows and next-token logits, the flags."""
        slots, P = start.slots, self.max_prompt_tokens
        if start.prefill is not None:
            slot_t = torch.as_tensor(slots, device=self.device)
            self._set_next(slot_t, self.decoder.write_prefill(slot_t, *start.prefill))
        self.input_ids[slots] = self.pad_id
        self.attention_mask[slots] = 0
        self.input_ids[slots, :P], self.attention_mask[slots, :P] = start.block_ids, start.block_mask
        for row, slot in enumerate(slots):
            self.prompt_text[slot] = start.prompts[row]
        self.length[slots] = 0
        self.started[slots] = True
        self.done[slots] = False
        self.deferred[slots] = start.deferred
        self.stale[slots] = False
        if self.turns is not None:
            self.turns.begin(slots, start.prompts, start.seeds)

    def _refresh_stale(self) -> None:
        """π_ref's cache re-reads the conversations a partner's reply was added to (step mode), so their next
        token's log π_ref is known; before the step changes anything, so a failure here leaves it undone."""
        rows = np.flatnonzero(self.stale & self.started & ~self.done & ~self.deferred)
        if rows.size == 0:
            return
        ids, mask = context_rows(self.input_ids, self.attention_mask, rows, self.max_prompt_tokens)
        rows_t = torch.as_tensor(rows, device=self.device)
        with self._reference_forward():
            logits = self.decoder.prefill(rows_t, torch.as_tensor(ids, device=self.device),
                                          torch.as_tensor(mask, device=self.device))  # fmt: skip
        self._set_next(rows_t, logits)
        self.stale[rows] = False

    def _reference_forward(self):
        """The context π_ref's (and the reward models') forwards run in: their own dtypes whatever autocast the
        caller runs the policy under.

        Why: a collector that keeps one bf16 autocast region open over a whole rollout (so the policy's
        weights are cast once, not once per step) must not turn π_ref's fp32 log-probs into bf16 ones.
        """
        return torch.autocast(self.device.type, enabled=False)

    def _set_next(self, rows: torch.Tensor | slice, logits: torch.Tensor) -> None:
        logits = logits[:, : self.vocab_size]  # some checkpoints pad the LM head beyond the vocabulary
        if isinstance(rows, slice):
            self.next_logits, self.next_lse = logits, torch.logsumexp(logits, dim=-1)
        else:
            self.next_logits[rows] = logits
            self.next_lse[rows] = torch.logsumexp(logits, dim=-1)

    def prompt_ids(self, slot: int) -> list[int]:
        """The prompt's token ids as fed to π_ref (read back from the observation, not re-tokenised)."""
        P = self.max_prompt_tokens
        return self.input_ids[slot, :P][self.attention_mask[slot, :P] == 1].tolist()

    def response_ids(self, slot: int) -> list[int]:
        P = self.max_prompt_tokens
        return self.input_ids[slot, P : P + self.length[slot]].tolist()

    def response_text(self, slot: int) -> str:
        ids = [t for t in self.response_ids(slot) if t not in self.stop_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def advance(self, actions: np.ndarray, live: np.ndarray) -> dict[str, Any]:
        """Apply ``actions`` to the ``live`` slots; one batched π_ref forward, one batched RM call.

        Returns a dict of (N,) arrays: reward, terminated, truncated, ref_logprob; ``final``, a
        {slot: info} dict for the episodes that ended on this step; and ``turn``, a {slot: info} dict for
        the slots whose turn ended on it (``turn_reward``, the partner's ``reply``; multi-turn only).
        """
        self._refresh_stale()
        n = len(actions)
        idx = np.flatnonzero(live)
        acts = torch.as_tensor(actions, device=self.device)
        ref_lp = np.zeros(n, dtype=np.float64)
        stepped = live & ~self.deferred  # slots whose π_ref log-prob is read now from the cached next-token logits
        idx_t = torch.as_tensor(np.flatnonzero(stepped), device=self.device)
        ref_lp[stepped] = (self.next_logits[idx_t, acts[idx_t]] - self.next_lse[idx_t]).double().cpu().numpy()
        ref_lp[live & self.deferred] = np.nan  # known at the episode's end (info["ref_logprobs"])
        col = self.max_prompt_tokens + self.length[idx]
        self._write(idx, actions[idx], policy=True)
        # The length cap is a terminal state of this MDP, not an outside time limit: the observation
        # encodes the step and the score is paid there. `truncated` would make SB3 & co. bootstrap
        # γ·V(s_T) on top of the score. `truncated` stays False: it is for users' TimeLimit wrappers.
        stopped = np.zeros(n, dtype=bool)
        capped = np.zeros(n, dtype=bool)
        stopped[idx] = np.isin(actions[idx], self.stop_array)
        turn_end = np.zeros(n, dtype=bool)  # the turn reached max_turn_tokens: answered as a stop token would be,
        if self.turns is not None:  # on the budget's last column too (the cap then ends the episode after the answer)
            turn_end[idx] = self.turns.turn_capped(idx, self.length)
        capped[idx] = ~stopped[idx] & ~turn_end[idx] & (self.length[idx] >= self.max_new_tokens)
        done_before = self.done.copy()
        reward = np.where(stepped, self.kl_coef * ref_lp, 0.0)
        snapshot = None  # the conversations a turn ended in, as they were: restored if the step fails after them
        try:
            ended, replies, turn, snapshot = self._end_turns(idx, stopped | turn_end, capped, reward)
            self.done |= ended
            with self._reference_forward():  # π_ref and the reward models in their own dtypes
                final = self._finish(np.flatnonzero(ended), capped, reward) if ended.any() else {}
                if (stepped & ~ended).any():
                    feed = torch.where(torch.as_tensor(stepped & ~ended, device=self.device), acts, self.eos_id)
                    self._set_next(slice(None), self.decoder.step(feed))  # restores its cache if it raises
        except BaseException:
            # Any failure, KeyboardInterrupt and a reward timeout included, leaves no half-applied step:
            # the token is undone so the step can be retried, and no slot is left done without its info.
            self.length[idx] -= 1
            self.input_ids[idx, col] = self.pad_id
            self.attention_mask[idx, col] = 0
            self.done = done_before
            if self.turns is not None:
                self.turns.policy_mask[idx, col - self.max_prompt_tokens] = False
            if snapshot is not None:
                self.turns.restore(snapshot)
            raise
        for s, ids in replies.items():  # the partners' replies become observation: never the policy's
            self._write(np.array([s]), np.array(ids, dtype=np.int64), policy=False)
            self.stale[s] = True
        return {"reward": reward, "terminated": ended, "truncated": np.zeros(n, dtype=bool), "ref_logprob": ref_lp,
                "final": final, "turn": turn}  # fmt: skip

    def _write(self, slots: np.ndarray, ids: np.ndarray, policy: bool) -> None:
        """Append tokens to the slots' responses: one per slot (``policy``: the actions), or one slot's reply."""
        P = self.max_prompt_tokens
        if policy:
            col = P + self.length[slots]
            self.input_ids[slots, col] = ids
            self.attention_mask[slots, col] = 1
            if self.turns is not None:
                self.turns.policy_mask[slots, col - P] = True
            self.length[slots] += 1
            return
        s, k = int(slots[0]), len(ids)
        start = P + self.length[s]
        self.input_ids[s, start : start + k] = ids
        self.attention_mask[s, start : start + k] = 1
        self.length[s] += k

    def _end_turns(
        self, idx: np.ndarray, turn_over: np.ndarray, capped: np.ndarray, reward: np.ndarray
    ) -> tuple[np.ndarray, dict[int, list[int]], dict[int, dict], dict | None]:
        """Which slots end their episode on this step, the replies to write after it, and the turn infos.

        ``turn_over``: a stop token, or with a partner ``max_turn_tokens``, ended the slot's turn; ``capped``: the
        length cap cut a response (a turn) short. Without a partner an episode is one turn: a stop token or the
        cap ends it. With one, the turn's end has its partner answer, its reward paid on this step,
        and the episode ends if the partner says done, at ``max_turns``, or when its reply would leave no
        column for the policy's next token (the conversation's cap). The reply's tokens are returned, to be
        written once the step has succeeded, with the ended turns' conversations as they were (``Turns.snapshot``).
        """
        if self.turns is None:
            return turn_over | capped, {}, {}, None
        P, turns = self.max_prompt_tokens, self.turns
        ending = idx[turn_over[idx]]
        texts = [self._turn_text(s) for s in ending]
        answers = turns.ask(ending, texts)
        over = turns.over(ending, answers)
        last = self.length[ending] - 1  # each turn's last token: its column in the response block
        room = self.max_new_tokens - 1 - self.length[ending]  # a reply must leave the policy a column to speak
        # None: the episode ends here (the partner said so, or no room left: the conversation's cap ends it)
        reply_ids = [None if over[k] else turns.template.ids(answers[k][0], int(self.input_ids[s, P + last[k]]),
                                                              int(room[k])) for k, s in enumerate(ending)]  # fmt: skip
        snapshot = turns.snapshot(ending)  # from here on the conversations change
        ended, replies, infos = capped.copy(), {}, {}
        for k, s in enumerate(ending):
            s, ids = int(s), reply_ids[k]
            ended[s] = ids is None
            reward[s] += answers[k][1]
            turns.commit(s, texts[k], answers[k], int(last[k]), ids)
            if ids is not None:
                replies[s] = ids
            infos[s] = {"turn_reward": np.float64(answers[k][1]), "reply": self._shown_reply(answers[k][0])}
        return ended, replies, infos, snapshot

    def _shown_reply(self, text: str) -> str:
        """A reply as ``info["reply"]`` shows it: whole, or cut past what any reply of this conversation can hold."""
        limit = self.max_new_tokens * self.turns.template.max_token_chars
        if len(text) <= limit:
            return text
        return f"{text[:limit]}… [{len(text) - limit} more characters cut: no reply can hold more than {limit}]"

    def _turn_text(self, slot: int) -> str:
        """The text of the policy's current turn in ``slot`` (its stop token left out)."""
        P = self.max_prompt_tokens
        ids = self.input_ids[slot, P + self.turns.turn_start[slot] : P + self.length[slot]].tolist()
        return self.tokenizer.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=True)

    def _finish(self, slots: np.ndarray, capped: np.ndarray, reward: np.ndarray) -> dict[int, dict]:
        """Score the episodes ending now (one batched call per scorer) and add the end reward."""
        episodes = self._scored_episodes(slots)
        named = [int(s) for s in slots] if self.num_slots > 1 else None  # errors name the slot, not the batch row
        if self.reward_model is not None:
            rm = score_checked(self.reward_model, episodes, slots=named, timeout=self.reward_timeout)
        else:  # a conversation whose rewards are all its partner's
            rm = np.zeros(len(slots))
        if self.gold_scorer is not None:
            gold = score_checked(self.gold_scorer, episodes, slots=named, timeout=self.reward_timeout)
        elif self.turns is not None:  # a partner's rewards are the task's own (a game's outcome): its gold
            gold = np.array([self.turns.turn_reward[s].sum() for s in slots])
        else:
            gold = np.full(len(slots), np.nan)
        score = (rm - self.norm[0]) / self.norm[1] if self.norm is not None else rm
        late = self._episode_reference(slots[self.deferred[slots]])  # {slot: (T,) log π_ref} of deferred slots
        final = {}
        for k, s in enumerate(slots):
            s = int(s)
            penalty = self.missing_eos_penalty if capped[s] else 0.0
            reward[s] += score[k] - penalty
            extra = self._turn_infos(s, capped[s]) if self.turns is not None else {}
            if s in late:  # the whole episode's β·Σ_t log π_ref is paid here, and each token's part is named
                ref_lp = late[s] * self._policy_columns(s)  # the partner's tokens are observation: no KL on them
                extra.update(self._token_rewards(s, ref_lp, score[k] - penalty))
                reward[s] += self.kl_coef * ref_lp.sum()
            # numpy scalars: TorchRL's info readers need a dtype (a float64 is also a Python float)
            final[s] = {
                "rm_score": np.float64(rm[k]),
                "score_reward": np.float64(score[k]),
                "eos_penalty": np.float64(-penalty),
                "gold_score": np.float64(gold[k]),
                "prompt": episodes.prompts[k],
                "response": episodes.responses[k],
                "response_length": np.int64(self._policy_columns(s).sum()),
                "length_capped": np.bool_(capped[s]),
                **extra,
            }
        return final

    def _scored_episodes(self, slots: np.ndarray) -> Episodes:
        """What the scorers read: the prompt and the response; in a conversation the opening and the policy's
        last turn (its final answer; the whole conversation is the info's ``conversation``)."""
        if self.turns is None:
            responses, response_ids = [self.response_text(s) for s in slots], [self.response_ids(s) for s in slots]
        else:
            P = self.max_prompt_tokens
            responses = [self._turn_text(s) for s in slots]
            response_ids = [self.input_ids[s, P + self.turns.turn_start[s] : P + self.length[s]].tolist()
                            for s in slots]  # fmt: skip
        return Episodes(prompts=[self.prompt_text[s] for s in slots], responses=responses,
                        prompt_ids=[self.prompt_ids(s) for s in slots], response_ids=response_ids)  # fmt: skip

    def _policy_columns(self, slot: int) -> np.ndarray:
        """``(length,)`` float64: 1 on the response columns that are the policy's tokens, 0 on a partner's."""
        if self.turns is None:
            return np.ones(int(self.length[slot]))
        return self.turns.policy_mask[slot, : self.length[slot]].astype(np.float64)

    def _turn_infos(self, slot: int, capped: bool) -> dict[str, Any]:
        """A finished conversation's infos: its turns, the partner's rewards summed, the messages."""
        messages = list(self.turns.messages[slot])
        if capped:  # cut mid-turn by the conversation's cap: the partial turn is the last message
            messages.append({"role": "assistant", "content": self._turn_text(slot)})
        return {
            "turns": np.int64(self.turns.turns[slot] + capped),
            "turn_reward_sum": np.float64(self.turns.turn_reward[slot].sum()),
            "conversation": messages,
            "conversation_length": np.int64(self.length[slot]),
        }

    def _token_rewards(self, slot: int, ref_lp: np.ndarray, end_reward: float) -> dict[str, np.ndarray]:
        """The per-token infos of an episode scored at its end: what stepping it would have paid, token by token.

        ``ref_logprobs`` (T,) is log π_ref(a_t|s_t), ``token_rewards`` (T,) is β·log π_ref(a_t|s_t) plus a turn's
        reward on its last token and, on the last token, the score minus the missing-EOS penalty; both are 0
        past the response and on a partner's tokens (observation, not actions).
        """
        length = int(self.length[slot])
        ref_logprobs = np.zeros(self.max_new_tokens, dtype=np.float64)
        ref_logprobs[:length] = ref_lp
        token_rewards = self.kl_coef * ref_logprobs
        if self.turns is not None:
            token_rewards += self.turns.turn_reward[slot]
        token_rewards[length - 1] += end_reward
        return {"ref_logprobs": ref_logprobs, "token_rewards": token_rewards}

    @torch.no_grad()
    def _episode_reference(self, slots: np.ndarray) -> dict[int, np.ndarray]:
        """log π_ref(a_t|s_t) of every response token of the finished ``slots``, in teacher-forced forwards.

        The observation holds the whole episode, so one forward over it gives every token's π_ref
        log-prob at once (causal attention: column c sees columns ≤ c, as the cached step did). The LM
        head runs on the policy's tokens only, in chunks (:func:`textgym.token_logprobs.policy_logprobs`:
        a partner's reply, the prompt block and padding never meet it); rows go in groups whose columns
        start at the group's longest prompt and stop at its longest response.

        Returns:
            ``{slot: (length,) float64}``, 0 on a partner's tokens.
        """
        out: dict[int, np.ndarray] = {}
        P = self.max_prompt_tokens
        for i in range(0, len(slots), _TEACHER_FORCED_ROWS):
            chunk = slots[i : i + _TEACHER_FORCED_ROWS]
            width = int(self.length[chunk].max())
            ids = torch.as_tensor(self.input_ids[chunk, : P + width], device=self.device)  # (k, P + width)
            mask = torch.as_tensor(self.attention_mask[chunk, : P + width], device=self.device)
            select = torch.as_tensor(np.stack([np.pad(self._policy_columns(s), (0, width - self.length[s]))
                                               for s in chunk]) > 0, device=self.device)  # (k, width)  # fmt: skip
            with self.decoder.context():
                logp, _ = policy_logprobs(self.model, ids, mask, P, select, vocab_size=self.vocab_size)  # (k, width)
            logp = logp.double().cpu().numpy()  # one copy to the host for the group
            for row, s in enumerate(chunk):
                out[int(s)] = logp[row, : self.length[s]]
        return out

    def action_masks(self) -> np.ndarray:
        """``(N, V)`` bool: π_ref's top-p tokens at each slot's state (all True without ``action_mask_top_p``).

        The NLPO idea of RL4LMs (Ramamurthy et al., 2023): restrict the policy to tokens the
        reference model finds plausible. The smallest set whose π_ref mass reaches p is kept.
        """
        n = self.next_logits.shape[0]
        self._refresh_stale()
        if self.action_mask_top_p is None:
            return np.ones((n, self.vocab_size), dtype=bool)
        if (self.deferred & self.started & ~self.done).any():
            raise RuntimeError(
                "action_masks() needs π_ref's next-token distribution at every step, which an episode started with "
                "reference_scoring='episode' does not compute; use reference_scoring='step' with action_mask_top_p"
            )
        probs = torch.softmax(self.next_logits, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above
        keep_sorted = before < self.action_mask_top_p  # the top token is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        return keep.cpu().numpy()

    def render(self, slot: int) -> str:
        return self.prompt_text[slot] + self.response_text(slot)
