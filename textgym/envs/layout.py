"""The slots' observations: one fixed layout for every episode, single-turn or a conversation.

A slot's row, length ``L = P + T`` (``P = max_prompt_tokens``, ``T = max_new_tokens``)::

    [PAD … PAD, prompt tokens][response tokens, PAD … PAD]
    |<------------ P -------->|<---------- T ---------->|

The prompt is left-padded into the first block so that response token k always sits at column
``P + k``; ``attention_mask`` marks the real tokens. The response block holds the policy's tokens and,
in a conversation, the partner's replies between its turns; ``policy_mask`` (N, T) says which columns
are the policy's (its actions: the only ones charged a KL and a loss). In a single-turn episode every
response column is the policy's.

A step reads the rows as they will be once its actions are written (:meth:`Layout.rows` with a
:class:`Move`) and writes nothing until every part of the env has answered (:meth:`Layout.apply`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from textgym.models import context_rows

__all__ = ["Layout", "Move", "Rows"]


@dataclasses.dataclass(frozen=True)
class Move:
    """One step's actions before they are written: ``tokens[k]`` is appended to slot ``slots[k]``'s response."""

    slots: np.ndarray  # (k,) int: the live slots
    tokens: np.ndarray  # (k,) int64


@dataclasses.dataclass(frozen=True)
class Rows:
    """Copies of some slots' rows as a pending :class:`Move` leaves them: what a prepared step reads."""

    slots: np.ndarray  # (k,)
    input_ids: np.ndarray  # (k, L)
    attention_mask: np.ndarray  # (k, L)
    length: np.ndarray  # (k,) response columns used
    policy: np.ndarray  # (k, T) bool: the policy's columns
    prompt_tokens: int  # P

    def subset(self, keep: np.ndarray) -> Rows:
        """The rows where ``keep`` (k,) is True."""
        return Rows(self.slots[keep], self.input_ids[keep], self.attention_mask[keep], self.length[keep],
                    self.policy[keep], self.prompt_tokens)  # fmt: skip

    def response_ids(self, row: int, start: int = 0) -> list[int]:
        """Row ``row``'s response tokens from response column ``start`` on."""
        P = self.prompt_tokens
        return self.input_ids[row, P + start : P + self.length[row]].tolist()

    def policy_columns(self, row: int) -> np.ndarray:
        """``(length,)`` float64: 1 on the policy's response columns, 0 on a partner's."""
        return self.policy[row, : self.length[row]].astype(np.float64)


class Layout:
    """The observation rows of N slots, their lengths, the policy's columns and the slots' flags."""

    def __init__(self, num_slots: int, prompt_tokens: int, new_tokens: int, pad_id: int):
        n, L = num_slots, prompt_tokens + new_tokens
        self.num_slots, self.prompt_tokens, self.new_tokens, self.pad_id = num_slots, prompt_tokens, new_tokens, pad_id
        self.input_ids = np.full((n, L), pad_id, dtype=np.int64)
        self.attention_mask = np.zeros((n, L), dtype=np.int64)
        self.length = np.zeros(n, dtype=np.int64)  # response columns used
        self.policy_mask = np.zeros((n, new_tokens), dtype=bool)  # (N, T) the policy's columns
        self.started = np.zeros(n, dtype=bool)
        self.done = np.zeros(n, dtype=bool)
        self.prompt_text: list[str] = [""] * n

    def observation(self, slots) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids[slots].copy(), "attention_mask": self.attention_mask[slots].copy()}

    def prompt_ids(self, slot: int) -> list[int]:
        """The prompt's token ids as fed to π_ref (read back from the observation, not re-tokenised)."""
        P = self.prompt_tokens
        return self.input_ids[slot, :P][self.attention_mask[slot, :P] == 1].tolist()

    def response_ids(self, slot: int) -> list[int]:
        P = self.prompt_tokens
        return self.input_ids[slot, P : P + self.length[slot]].tolist()

    def context(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ``rows``' columns from their first real token to their last (what a cache re-reads)."""
        return context_rows(self.input_ids, self.attention_mask, rows, self.prompt_tokens)

    def start(self, slots: list[int], block_ids: np.ndarray, block_mask: np.ndarray, prompts: list[str]) -> None:
        """Empty the slots' rows and write their prompt blocks ``(k, P)``: new episodes."""
        P = self.prompt_tokens
        self.input_ids[slots] = self.pad_id
        self.attention_mask[slots] = 0
        self.input_ids[slots, :P], self.attention_mask[slots, :P] = block_ids, block_mask
        self.policy_mask[slots] = False
        for row, slot in enumerate(slots):
            self.prompt_text[slot] = prompts[row]
        self.length[slots] = 0
        self.started[slots] = True
        self.done[slots] = False

    def rows(self, slots: np.ndarray, move: Move) -> Rows:
        """Copies of ``slots``' rows with ``move``'s tokens written (a slot the move skips is copied as it is)."""
        slots = np.asarray(slots, dtype=np.int64)
        ids, mask = self.input_ids[slots], self.attention_mask[slots]
        length, policy = self.length[slots], self.policy_mask[slots]
        moved = np.isin(slots, move.slots)
        if moved.any():
            rows = np.flatnonzero(moved)
            tokens = move.tokens[np.searchsorted(move.slots, slots[rows])]
            ids[rows, self.prompt_tokens + length[rows]] = tokens
            mask[rows, self.prompt_tokens + length[rows]] = 1
            policy[rows, length[rows]] = True
            length = length + moved
        return Rows(slots, ids, mask, length, policy, self.prompt_tokens)

    def apply(self, move: Move) -> None:
        """Write ``move``: one policy token appended to each of its slots."""
        col = self.length[move.slots]
        self.input_ids[move.slots, self.prompt_tokens + col] = move.tokens
        self.attention_mask[move.slots, self.prompt_tokens + col] = 1
        self.policy_mask[move.slots, col] = True
        self.length[move.slots] += 1

    def append_reply(self, slot: int, ids: list[int]) -> None:
        """Append a partner's reply to ``slot``'s response: observation, not the policy's columns."""
        start, k = self.prompt_tokens + self.length[slot], len(ids)
        self.input_ids[slot, start : start + k] = ids
        self.attention_mask[slot, start : start + k] = 1
        self.length[slot] += k
