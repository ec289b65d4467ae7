"""Multi-turn episodes in the engine's one layout: the partner's replies between the policy's turns.

The response block of a slot (``max_new_tokens`` columns after the prompt block) holds the whole
conversation after the opening: the policy's tokens and, after each of its turns, the partner's
reply. the layout's ``policy_mask`` says which columns are the policy's (its actions; the only ones charged a
KL and a loss); the reply's columns are observation, fed to π_ref and the policy like the prompt.
A single-turn episode is the case in which nobody answers (:class:`~textgym.envs.dialogue.OneTurn`).

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
from textgym.envs.dialogue import Answers, Summary
from textgym.partners import PartnerError, close_checked, make_partner, reply_checked, reset_checked, verdict_checked

__all__ = ["Conversation", "ReplyTemplate"]

_PROBED_OPENINGS = 4  # partner seeds whose openings size the prompt block when max_prompt_tokens is not given

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


class Conversation:
    """The conversation state of N slots, each with its own partner (see the module docstring): the
    :class:`~textgym.envs.dialogue.Dialogue` of a multi-turn episode.

    Arrays over the response block (``T = max_new_tokens`` columns): ``turn_reward`` (N, T) float64 (a turn's
    reward on its last token); per slot: ``turn_starts`` (the column the policy's current turn began at),
    ``turns`` (turns ended), ``seed`` (the partner's), ``messages`` (the chat so far).
    """

    has_partner = True

    def __init__(self, partner: Any, num_slots: int, max_new_tokens: int, template: ReplyTemplate,
                 max_turns: int | None = None, max_turn_tokens: int | None = None,
                 partner_timeout: float | None = None):  # fmt: skip
        self.max_turns = None if max_turns is None else check_int("max_turns", max_turns, 1)
        self.max_turn_tokens = None if max_turn_tokens is None else check_int("max_turn_tokens", max_turn_tokens, 1)
        self.timeout = check_timeout(partner_timeout, "partner_timeout")
        factory = make_partner(partner, "partner")
        self.partners = [factory() for _ in range(num_slots)]
        self.template = template
        n, T = num_slots, max_new_tokens
        self.new_tokens = T
        self.turn_reward = np.zeros((n, T), dtype=np.float64)
        self.turn_starts = np.zeros(n, dtype=np.int64)
        self.turns = np.zeros(n, dtype=np.int64)
        self.seed = np.zeros(n, dtype=np.int64)
        self.messages: list[list[dict[str, str]]] = [[] for _ in range(n)]

    def probe(self, prompt: str) -> list[tuple[str, str]]:
        """The openings of partner seeds 0-3 (a game's rules): the prompt block is sized by them, with a margin."""
        seeds = list(range(_PROBED_OPENINGS))
        openings = self._reset([0] * len(seeds), [prompt] * len(seeds), seeds)
        return [(f"the partner's opening for seed {k}", p) for k, p in enumerate(openings) if p != prompt]

    def openings(self, slots: Sequence[int], prompts: list[str], seeds: list[int] | None) -> list[str]:
        """Reset each slot's partner for a new episode; the prompt each starts from (the partner's opening,
        or the drawn prompt when the partner has none)."""
        return self._reset(slots, prompts, [0] * len(slots) if seeds is None else seeds)

    def _reset(self, slots: Sequence[int], prompts: Sequence[str], seeds: Sequence[int]) -> list[str]:
        out = []
        for s, prompt, seed in zip(slots, prompts, seeds, strict=True):
            opening = reset_checked(self.partners[s], int(seed), prompt, self.timeout, slot=int(s))
            out.append(prompt if opening is None else opening)
        return out

    def begin(self, slots: Sequence[int], prompts: Sequence[str], seeds: list[int] | None) -> None:
        """The slots' episodes start (their prompts accepted): empty conversations after the opening."""
        self.turn_reward[slots] = 0.0
        self.turn_starts[slots] = 0
        self.turns[slots] = 0
        self.seed[slots] = [0] * len(slots) if seeds is None else seeds
        for s, prompt in zip(slots, prompts, strict=True):
            self.messages[s] = [{"role": "user", "content": prompt}]

    def turn_start(self, slot: int) -> int:
        return int(self.turn_starts[slot])

    def turn_over(self, slots: np.ndarray, stopped: np.ndarray, length: np.ndarray) -> np.ndarray:
        """A stop token or ``max_turn_tokens`` ends the turn (the budget's last column too: the cap then ends
        the episode after the answer)."""
        if self.max_turn_tokens is None:
            return stopped
        return stopped | (length - self.turn_starts[slots] >= self.max_turn_tokens)

    def answer(self, slots: np.ndarray, texts: list[str], last: np.ndarray, length: np.ndarray,
               new_tokens: int) -> Answers:  # fmt: skip
        """The partners' answers to the turns just ended on ``slots``; nothing changes until :meth:`commit`.

        The episode ends if the partner says done, at ``max_turns``, or when its reply would leave no column
        for the policy's next token (the conversation's cap). ``last``: each turn's last token; ``length``:
        the response columns used after it.
        """
        answers = [self._ask(int(s), text) for s, text in zip(slots, texts, strict=True)]
        done = np.array([d for _, _, d in answers], dtype=bool)
        if self.max_turns is not None:
            done |= self.turns[slots] + 1 >= self.max_turns
        room = new_tokens - 1 - length  # a reply must leave the policy a column to speak
        # None: the episode ends here (the partner said so, or no room left: the conversation's cap ends it)
        ids = [None if done[k] else self.template.ids(answers[k][0], int(last[k]), int(room[k]))
               for k in range(len(slots))]  # fmt: skip
        replies = {int(s): i for s, i in zip(slots, ids, strict=True) if i is not None}
        infos = {int(s): {"turn_reward": np.float64(a[1]), "reply": self._shown_reply(a[0])}
                 for s, a in zip(slots, answers, strict=True)}  # fmt: skip
        records = {int(s): (texts[k], answers[k], int(length[k]) - 1, ids[k]) for k, s in enumerate(slots)}
        over = np.array([i is None for i in ids], dtype=bool)
        return Answers(slots, over, np.array([a[1] for a in answers], dtype=np.float64), replies, infos, records)

    def _ask(self, slot: int, text: str) -> tuple[str, float, bool]:
        conversation = [*copy.deepcopy(self.messages[slot]), {"role": "assistant", "content": text}]
        return reply_checked(self.partners[slot], conversation, self.timeout, slot=slot)

    def _shown_reply(self, text: str) -> str:
        """A reply as ``info["reply"]`` shows it: whole, or cut past what any reply of this conversation can hold."""
        limit = self.new_tokens * self.template.max_token_chars
        if len(text) <= limit:
            return text
        return f"{text[:limit]}… [{len(text) - limit} more characters cut: no reply can hold more than {limit}]"

    def commit(self, answers: Answers) -> None:
        """Record each ended turn (its last token at response column ``last``) and the reply written after it."""
        for slot, (turn_text, (text, reward, _), last, reply_ids) in answers.records.items():
            self.turn_reward[slot, last] = reward
            self.turns[slot] += 1
            self.messages[slot].append({"role": "assistant", "content": turn_text})
            if reply_ids is not None:
                self.messages[slot].append({"role": "user", "content": text})
                self.turn_starts[slot] = last + 1 + len(reply_ids)

    def summary(self, slot: int, answers: Answers, capped: bool, turn_text: str, length: int) -> Summary:
        """A finished conversation: its turn rewards, their sum (the task's gold without a gold scorer), its turns
        and messages, with the turn that ended on this step counted."""
        turn_reward, turns = self.turn_reward[slot].copy(), int(self.turns[slot])
        messages = list(self.messages[slot])
        if slot in answers.records:  # its turn ended on this step
            text, (_, reward, _), last, _ = answers.records[slot]
            turn_reward[last], turns = reward, turns + 1
            messages.append({"role": "assistant", "content": text})
        if capped:  # cut mid-turn by the conversation's cap: the partial turn is the last message
            messages.append({"role": "assistant", "content": turn_text})
        total = turn_reward.sum()
        infos = {"turns": np.int64(turns + capped), "turn_reward_sum": np.float64(total), "conversation": messages,
                 "conversation_length": np.int64(length)}  # fmt: skip
        verdict = verdict_checked(self.partners[slot], self.timeout, slot=slot)
        return Summary(turn_reward, float(total), infos, float("nan") if verdict is None else float(verdict))

    def close(self) -> None:
        """Close every slot's partner that has a ``close`` (an OpenEnv session, a game server's socket), each once.

        Why all before raising: one partner that fails to close must not leave the others' sessions open; the
        first failure is raised after, as a :class:`PartnerError` naming its partner and slot.
        """
        partners, self.partners = self.partners, []
        failures = []
        for slot, partner in enumerate(partners):
            try:
                close_checked(partner, self.timeout, slot=slot)
            except PartnerError as err:
                failures.append(err)
        if failures:
            raise failures[0]
