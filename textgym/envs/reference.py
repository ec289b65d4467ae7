"""π_ref over the env's slots: its cached decoder, log π_ref of each action, of whole episodes, and top-p masks.

Two ways to score (``reference_scoring``): at each step, from the next-token logits a cached forward
left (Gymnasium's per-step reward), or once the episode ends, in one teacher-forced forward over the
finished rows (what the collectors use). Each slot keeps the way it started with (``deferred``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from textgym.envs.layout import Layout, Rows
from textgym.models import left_pad
from textgym.ring_decoder import make_decoder
from textgym.token_logprobs import policy_logprobs

__all__ = ["REFERENCE_SCORING", "Prefill", "Reference", "check_reference_scoring", "own_dtypes"]

REFERENCE_SCORING = ("step", "episode")
_TEACHER_FORCED_ROWS = 64  # episodes per teacher-forced forward: bounds the body's activations (the head is chunked)


def check_reference_scoring(reference_scoring: str) -> str:
    """``reference_scoring``: one of :data:`REFERENCE_SCORING`."""
    if reference_scoring not in REFERENCE_SCORING:
        raise ValueError(f"reference_scoring={reference_scoring!r} is not one of {REFERENCE_SCORING}")
    return reference_scoring


def own_dtypes(device: torch.device):
    """The context π_ref's (and the reward models') forwards run in: their own dtypes whatever autocast the
    caller runs the policy under.

    Why: a collector that keeps one bf16 autocast region open over a whole rollout (so the policy's
    weights are cast once, not once per step) must not turn π_ref's fp32 log-probs into bf16 ones.
    """
    return torch.autocast(device.type, enabled=False)


@dataclasses.dataclass(frozen=True)
class Prefill:
    """New episodes' prompt blocks and, in step mode, π_ref's prefill forward over them: computed, not written."""

    block_ids: np.ndarray  # (k, P) left-padded
    block_mask: np.ndarray  # (k, P)
    deferred: bool  # π_ref scores these episodes at their end
    forward: tuple | None  # (the decoder's prefill output, its mask) in step mode


class Reference:
    """π_ref's state over N slots: next-token logits (N, V) and their log-sum-exp, the ring decoder's cache, which
    slots are scored at their end (``deferred``) and which must re-read their row (``stale``: a reply was added)."""

    def __init__(self, model, num_slots: int, seq_len: int, vocab_size: int, scoring: str, device: torch.device):
        self.model, self.vocab_size, self.device = model, vocab_size, device
        self.scoring = check_reference_scoring(scoring)
        self.decoder = make_decoder("auto", model, num_slots, seq_len)  # the ring: a decode step of fixed shapes
        self.deferred = np.zeros(num_slots, dtype=bool)
        self.stale = np.zeros(num_slots, dtype=bool)
        # log π_ref(a|s_t) = logit[a] − lse, one gather
        self.next_logits = torch.zeros(num_slots, vocab_size, device=device)  # (N, V)
        self.next_lse = torch.zeros(num_slots, device=device)  # (N,)

    def prepare(self, encoded: list[list[int]], block: int, tokenizer, pad_id: int) -> Prefill:
        """The prompt blocks of new episodes and, in step mode, π_ref's forward over them; nothing written."""
        block_ids, block_mask = left_pad(tokenizer, encoded, block, "np", pad_id)  # (k, P)
        deferred = self.scoring == "episode"
        forward = None
        if not deferred:  # an episode scored at its end needs no cache: π_ref reads it whole then
            width = max(len(e) for e in encoded)  # π_ref prefills only the columns some prompt uses
            mask = torch.as_tensor(block_mask[:, block - width :], device=self.device)
            with own_dtypes(self.device):
                out = self.decoder.forward_prefill(torch.as_tensor(block_ids[:, block - width :], device=self.device),
                                                   mask)  # fmt: skip
            forward = (out, mask)
        return Prefill(block_ids, block_mask, deferred, forward)

    def commit(self, slots: list[int], prefill: Prefill) -> None:
        """Write a :meth:`prepare`: the slots' cache rows, next-token logits and flags."""
        if prefill.forward is not None:
            slot_t = torch.as_tensor(slots, device=self.device)
            self._set_next(slot_t, self.decoder.write_prefill(slot_t, *prefill.forward))
        self.deferred[slots] = prefill.deferred
        self.stale[slots] = False

    def refresh(self, layout: Layout) -> None:
        """π_ref's cache re-reads the conversations a partner's reply was added to (step mode), so their next
        token's log π_ref is known. It computes what the observation already holds: a step that fails after it
        leaves the env as it was."""
        rows = np.flatnonzero(self.stale & layout.started & ~layout.done & ~self.deferred)
        if rows.size == 0:
            return
        ids, mask = layout.context(rows)
        rows_t = torch.as_tensor(rows, device=self.device)
        with own_dtypes(self.device):
            logits = self.decoder.prefill(rows_t, torch.as_tensor(ids, device=self.device),
                                          torch.as_tensor(mask, device=self.device))  # fmt: skip
        self._set_next(rows_t, logits)
        self.stale[rows] = False

    def logprobs(self, stepped: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """``(N,)`` float64 log π_ref(a|s_t) of the ``stepped`` slots' actions (0 elsewhere), from the cached logits."""
        out = np.zeros(len(actions), dtype=np.float64)
        idx = torch.as_tensor(np.flatnonzero(stepped), device=self.device)
        acts = torch.as_tensor(actions, device=self.device)
        out[stepped] = (self.next_logits[idx, acts[idx]] - self.next_lse[idx]).double().cpu().numpy()
        return out

    def step(self, fed: np.ndarray, actions: np.ndarray, filler: int) -> None:
        """Feed ``actions`` of the ``fed`` slots (``filler`` elsewhere) through the decoder: next-token logits for
        every slot. The decoder restores its cache if this raises, so it is the step's one write that can fail."""
        if not fed.any():
            return
        acts = torch.as_tensor(actions, device=self.device)
        feed = torch.where(torch.as_tensor(fed, device=self.device), acts, filler)
        with own_dtypes(self.device):
            self._set_next(slice(None), self.decoder.step(feed))

    def _set_next(self, rows: torch.Tensor | slice, logits: torch.Tensor) -> None:
        logits = logits[:, : self.vocab_size]  # some checkpoints pad the LM head beyond the vocabulary
        if isinstance(rows, slice):
            self.next_logits, self.next_lse = logits, torch.logsumexp(logits, dim=-1)
        else:
            self.next_logits[rows] = logits
            self.next_lse[rows] = torch.logsumexp(logits, dim=-1)

    @torch.no_grad()
    def episodes(self, rows: Rows) -> dict[int, np.ndarray]:
        """log π_ref(a_t|s_t) of every response token of the finished ``rows``, in teacher-forced forwards.

        The row holds the whole episode, so one forward over it gives every token's π_ref log-prob at
        once (causal attention: column c sees columns ≤ c, as the cached step did). The LM head runs on
        the policy's tokens only, in chunks (:func:`textgym.token_logprobs.policy_logprobs`: a partner's
        reply, the prompt block and padding never meet it); rows go in groups whose columns start at the
        group's longest prompt and stop at its longest response.

        Returns:
            ``{slot: (length,) float64}``, 0 on a partner's tokens.
        """
        out: dict[int, np.ndarray] = {}
        P = rows.prompt_tokens
        for i in range(0, len(rows.slots), _TEACHER_FORCED_ROWS):
            chunk = np.arange(i, min(i + _TEACHER_FORCED_ROWS, len(rows.slots)))
            width = int(rows.length[chunk].max())
            ids = torch.as_tensor(rows.input_ids[chunk, : P + width], device=self.device)  # (k, P + width)
            mask = torch.as_tensor(rows.attention_mask[chunk, : P + width], device=self.device)
            select = torch.as_tensor(rows.policy[chunk, :width], device=self.device)  # (k, width)
            with self.decoder.context():
                logp, _ = policy_logprobs(self.model, ids, mask, P, select, vocab_size=self.vocab_size)  # (k, width)
            logp = logp.double().cpu().numpy()  # one copy to the host for the group
            for k, row in enumerate(chunk):  # k: the row's place in this group's forward
                out[int(rows.slots[row])] = logp[k, : rows.length[row]]
        return out

    def top_p_masks(self, p: float | None, layout: Layout) -> np.ndarray:
        """``(N, V)`` bool: π_ref's top-p tokens at each slot's state (all True without ``p``).

        The NLPO idea of RL4LMs (Ramamurthy et al., 2023): restrict the policy to tokens the
        reference model finds plausible. The smallest set whose π_ref mass reaches p is kept.
        """
        n = self.next_logits.shape[0]
        self.refresh(layout)
        if p is None:
            return np.ones((n, self.vocab_size), dtype=bool)
        if (self.deferred & layout.started & ~layout.done).any():
            raise RuntimeError(
                "action_masks() needs π_ref's next-token distribution at every step, which an episode started with "
                "reference_scoring='episode' does not compute; use reference_scoring='step' with action_mask_top_p"
            )
        probs = torch.softmax(self.next_logits, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above
        keep_sorted = before < p  # the top token is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        return keep.cpu().numpy()
