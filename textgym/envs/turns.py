"""Multi-turn episodes in the engine's one layout: the partner's replies between the policy's turns.

The response block of a slot (``max_new_tokens`` columns after the prompt block) holds the whole
conversation after the opening: the policy's tokens and, after each of its turns, the partner's
reply. ``policy_mask`` says which columns are the policy's (its actions; the only ones charged a
KL and a loss); the reply's columns are observation, fed to π_ref and the policy like the prompt.
A single-turn episode is the case with no partner: every response column is the policy's.

A turn ends at a stop token or at ``max_turn_tokens``; the partner then gets the conversation as
chat messages and answers ``(text, reward, done)`` (:mod:`textgym.partners`). The turn's reward is
paid on its last token. The episode ends (terminated) when the partner says done, after
``max_turns`` turns, or when the conversation reaches ``max_new_tokens`` (mid-turn, or because
the reply leaves no column for the policy's next token).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from textgym.envs.checks import check_int, check_timeout

__all__ = ["ReplyTemplate", "Turns"]

_ASSISTANT = "\x1fTEXTGYM_ASSISTANT\x1f"  # placeholders no real message contains: they locate the template's pieces
_USER = "\x1fTEXTGYM_USER\x1f"


class ReplyTemplate:
    """How a partner's reply becomes tokens after the policy's turn: the user turn of the chat template
    (closing the assistant turn and opening the next), or the text between newlines without one.

    Why the template is rendered around placeholders once: the tokens of a reply must be exactly what
    the template writes between two turns, yet re-tokenising the whole conversation each turn would
    re-tokenise the policy's own tokens (which need not round-trip). The pieces before and after the
    reply's text are tokenised as template text (its special tokens become special ids), the reply's
    text with ``split_special_tokens`` (a partner's ``"<|im_end|>"`` stays text, as in prompts).
    """

    def __init__(self, tokenizer, chat_template: bool, stop_ids: set[int]):
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.before, self.after = ("\n", "\n")
        self.closing = ""  # what the template writes right after the assistant's text (its end-of-turn)
        if chat_template:
            self.before, self.after = self._pieces(tokenizer)

    @staticmethod
    def _pieces(tokenizer) -> tuple[str, str]:
        turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _ASSISTANT}]
        text = tokenizer.apply_chat_template([*turn, {"role": "user", "content": _USER}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        suffix = text[text.index(_ASSISTANT) + len(_ASSISTANT) :]
        before, _, after = suffix.partition(_USER)
        return before, after

    @functools.cached_property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token covers: twice its longest token's string.

        Why: a reply is only tokenised as far as it can fit. A token's string (byte-level ``Ġword``, ``▁word``,
        ``<0x0A>``) is at least as long as the text it covers; the factor 2 leaves room for normalisers
        that merge characters (NFKC).
        """
        tok = self.tokenizer
        return 2 * max(len(t) for t in tok.convert_ids_to_tokens(list(range(len(tok)))) if t is not None)

    def ids(self, text: str, last_token: int, room: int | None = None) -> list[int] | None:
        """The reply's tokens after a policy turn whose last token is ``last_token``; None if more than ``room``.

        A turn that ended on a stop token the template writes itself (``<|im_end|>``) already holds it:
        the template's copy is left out, so the turn is closed once. A reply longer than ``room`` tokens
        could hold is not tokenised at all: a partner's 10 MiB answer costs no time and no memory.
        """
        if room is not None and len(text) > max(room, 0) * self.max_token_chars:
            return None
        before = self.before
        closing = self.tokenizer.decode([last_token]) if last_token in self.stop_ids else ""
        if closing and before.startswith(closing):
            before = before[len(closing) :]
        tok = self.tokenizer
        out = tok(before, add_special_tokens=False)["input_ids"] if before else []
        out += tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []
        out += tok(self.after, add_special_tokens=False)["input_ids"] if self.after else []
        return out if room is None or len(out) <= room else None


class Turns:
    """The conversation state of N slots, each with its own partner (see the module docstring).

    Arrays over the response block (``T = max_new_tokens`` columns): ``policy_mask`` (N, T) bool and
    ``turn_reward`` (N, T) float64 (a turn's reward on its last token); per slot: ``turn_start`` (the
    column the policy's current turn began at), ``turns`` (turns ended), ``seed`` (the partner's).
    """

    def __init__(self, partner: Any, num_slots: int, max_new_tokens: int, template: ReplyTemplate,
                 max_turns: int | None = None, max_turn_tokens: int | None = None,
                 partner_timeout: float | None = None):  # fmt: skip
        self.max_turns = None if max_turns is None else check_int("max_turns", max_turns, 1)
        self.max_turn_tokens = None if max_turn_tokens is None else check_int("max_turn_tokens", max_turn_tokens, 1)
        self.timeout = check_timeout(partner_timeout, "partner_timeout")
        from textgym.partners import make_partner  # a single-turn env never imports the partners

        factory = make_partner(partner, "partner")
        self.partners = [factory() for _ in range(num_slots)]
        self.template = template
        n, T = num_slots, max_new_tokens
        self.policy_mask = np.zeros((n, T), dtype=bool)
        self.turn_reward = np.zeros((n, T), dtype=np.float64)
        self.turn_start = np.zeros(n, dtype=np.int64)
        self.turns = np.zeros(n, dtype=np.int64)
        self.seed = np.zeros(n, dtype=np.int64)
        self.messages: list[list[dict[str, str]]] = [[] for _ in range(n)]

    def openings(self, slots: Sequence[int], prompts: Sequence[str], seeds: Sequence[int]) -> list[str]:
        """Reset each slot's partner for a new episode; the prompt each starts from (the partner's opening,
        or the drawn prompt when the partner has none)."""
        out = []
        for s, prompt, seed in zip(slots, prompts, seeds, strict=True):
            opening = _partners().reset_checked(self.partners[s], int(seed), prompt, self.timeout, slot=int(s))
            out.append(prompt if opening is None else opening)
        return out

    def begin(self, slots: Sequence[int], prompts: Sequence[str], seeds: Sequence[int]) -> None:
        """The slots' episodes start (their prompts accepted): empty conversations after the opening."""
        self.policy_mask[slots] = False
        self.turn_reward[slots] = 0.0
        self.turn_start[slots] = 0
        self.turns[slots] = 0
        self.seed[slots] = seeds
        for s, prompt in zip(slots, prompts, strict=True):
            self.messages[s] = [{"role": "user", "content": prompt}]

    def turn_capped(self, slots: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Which of ``slots`` reached ``max_turn_tokens`` in their current turn (``length``: response columns used)."""
        if self.max_turn_tokens is None:
            return np.zeros(len(slots), dtype=bool)
        return length[slots] - self.turn_start[slots] >= self.max_turn_tokens

    def ask(self, slots: np.ndarray, turn_text: list[str]) -> list[tuple[str, float, bool]]:
        """The partners' answers to the turns just ended on ``slots`` (the policy's text of each turn).

        Nothing changes here: :meth:`commit` applies the answers once the whole step has succeeded, so a
        failure anywhere in the step leaves the conversations as they were.
        """
        out = []
        for s, text in zip(slots, turn_text, strict=True):
            conversation = [*copy.deepcopy(self.messages[s]), {"role": "assistant", "content": text}]
            out.append(_partners().reply_checked(self.partners[s], conversation, self.timeout, slot=int(s)))
        return out

    def over(self, slots: np.ndarray, answers: list[tuple[str, float, bool]]) -> np.ndarray:
        """Which of the answered ``slots`` end their episode: the partner said done, or the turn cap is reached."""
        done = np.array([d for _, _, d in answers], dtype=bool)
        if self.max_turns is not None:
            done |= self.turns[slots] + 1 >= self.max_turns
        return done

    def commit(self, slot: int, turn_text: str, answer: tuple[str, float, bool], last_col: int,
               reply_ids: list[int] | None) -> None:  # fmt: skip
        """Record the ended turn of ``slot`` (its last token at response column ``last_col``) and the reply
        written after it (``reply_ids``: None when the episode ended on this turn)."""
        text, reward, _ = answer
        self.turn_reward[slot, last_col] = reward
        self.turns[slot] += 1
        self.messages[slot].append({"role": "assistant", "content": turn_text})
        if reply_ids is not None:
            self.messages[slot].append({"role": "user", "content": text})
            self.turn_start[slot] = last_col + 1 + len(reply_ids)

    def snapshot(self, slots: np.ndarray) -> dict[str, Any]:
        """The slots' state, for :meth:`restore` when a step fails after a turn was recorded."""
        keys = ("policy_mask", "turn_reward", "turn_start", "turns")
        return {"slots": slots, **{k: getattr(self, k)[slots].copy() for k in keys},
                "messages": [list(self.messages[s]) for s in slots]}  # fmt: skip

    def restore(self, snap: dict[str, Any]) -> None:
        slots = snap["slots"]
        for key in ("policy_mask", "turn_reward", "turn_start", "turns"):
            getattr(self, key)[slots] = snap[key]
        for s, messages in zip(slots, snap["messages"], strict=True):
            self.messages[s] = messages


def _partners():
    import textgym.partners

    return textgym.partners
