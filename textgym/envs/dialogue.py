"""Who speaks after the policy's turn: nobody (:class:`OneTurn`, a single-turn episode) or a partner
(:class:`~textgym.envs.turns.Conversation`). The engine asks the same questions of both.

A step first asks (:meth:`Dialogue.answer`: which turns ended, the partners' answers and replies, nothing
written), then, once every part of the env has answered, commits (:meth:`Dialogue.commit`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["Answers", "Dialogue", "OneTurn", "Summary"]


@dataclasses.dataclass(frozen=True)
class Answers:
    """The answers to the turns that ended on a step (``slots``), nothing of them written yet."""

    slots: np.ndarray  # (k,) the slots whose turn ended
    over: np.ndarray  # (k,) bool: the episode ends with this turn
    rewards: np.ndarray  # (k,) float64: each turn's reward, paid on its last token
    replies: dict[int, list[int]]  # {slot: the reply's token ids}, written after the turn
    infos: dict[int, dict[str, Any]]  # {slot: the step's turn infos}
    records: dict = dataclasses.field(default_factory=dict)  # {slot: what :meth:`Dialogue.commit` writes}


@dataclasses.dataclass(frozen=True)
class Summary:
    """A finished episode as its dialogue sees it, once the step's answers are counted."""

    turn_rewards: np.ndarray  # (T,) float64: each turn's reward on its last response column
    gold: float  # the task's own score when no gold scorer is given (NaN: none)
    infos: dict[str, Any]  # what the final info adds (a conversation's turns and messages)
    verdict: float = float("nan")  # the partner's verdict: 1.0 the policy won, 0.0 not, NaN: it gives none


class Dialogue(Protocol):
    """What the engine asks of the other side of an episode (see the module docstring)."""

    has_partner: bool  # episodes are conversations: partner seeds are drawn, the reward model may be absent

    def probe(self, prompt: str) -> list[tuple[str, str]]:
        """(name, text) of a few openings, to size the prompt block by (none when the prompts are the openings)."""

    def openings(self, slots: Sequence[int], prompts: list[str], seeds: list[int] | None) -> list[str] | None:
        """Start the slots' partners; the texts the episodes open with, or None when they are ``prompts``."""

    def begin(self, slots: Sequence[int], prompts: Sequence[str], seeds: list[int] | None) -> None:
        """The slots' episodes start with ``prompts``."""

    def turn_start(self, slot: int) -> int:
        """The response column the policy's current turn began at."""

    def turn_over(self, slots: np.ndarray, stopped: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Which of ``slots`` end their turn now (``stopped``: on a stop token; ``length``: columns used after it)."""

    def answer(self, slots: np.ndarray, texts: list[str], last: np.ndarray, length: np.ndarray,
               new_tokens: int) -> Answers:  # fmt: skip
        """The answers to the turns ended on ``slots`` (their ``texts``, last tokens, columns used); no change."""

    def commit(self, answers: Answers) -> None:
        """Write ``answers``: the turns become part of the conversations."""

    def summary(self, slot: int, answers: Answers, capped: bool, turn_text: str, length: int) -> Summary:
        """The finished episode of ``slot`` with ``answers`` counted (``capped``: the length cap cut a turn)."""

    def close(self) -> None:
        """Release what the other side holds (a partner's server session); called once by the env's ``close``."""


class OneTurn:
    """A single-turn episode: a stop token or the length cap ends it, and nobody answers."""

    has_partner = False

    def __init__(self, new_tokens: int):
        self.new_tokens = new_tokens

    def probe(self, prompt: str) -> list[tuple[str, str]]:
        return []

    def openings(self, slots, prompts, seeds) -> None:
        return None

    def begin(self, slots, prompts, seeds) -> None:
        return None

    def turn_start(self, slot: int) -> int:
        return 0

    def turn_over(self, slots: np.ndarray, stopped: np.ndarray, length: np.ndarray) -> np.ndarray:
        return stopped

    def answer(self, slots, texts, last, length, new_tokens) -> Answers:
        k = len(slots)
        return Answers(slots, np.ones(k, dtype=bool), np.zeros(k), {}, {})

    def commit(self, answers: Answers) -> None:
        return None

    def summary(self, slot, answers, capped, turn_text, length) -> Summary:
        return Summary(np.zeros(self.new_tokens), float("nan"), {})

    def close(self) -> None:
        return None
