"""A causal LM sampling actions in TextRLHF-v0 with its own KV cache: one cached forward per token.

Used as the reference policy (``textgym play``, the benchmarks, the tests) and by the PPO
agent's rollout, where the policy being trained samples the actions. (The Stable-Baselines3
policy over the same LM is :class:`textgym.agents.sb3.LMPolicy`; this one is a sampler, not a
trainable SB3 policy.)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from textgym.functional import pack_mask, sample_categorical
from textgym.models import context_rows
from textgym.ring_decoder import make_decoder

__all__ = ["LMSampler", "kept_tokens", "restrict_logits", "truncate_logits"]


def truncate_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """``logits`` with every token outside the top-k, then the top-p (nucleus) set, at the dtype's lowest value.

    Sampling from the result, and its log-softmax, give the truncated distribution the tokens are
    drawn from. The lowest finite value, not -inf, keeps p·log p (entropy) finite.

    Args:
        logits: ``(..., V)``, already divided by the temperature (Hugging Face's order).
        top_k: keep the k largest logits (None: all).
        top_p: then keep the smallest set, by probability, whose probability reaches p (None: all).
    """
    if top_k is None and top_p is None:
        return logits
    return restrict_logits(logits, kept_tokens(logits, top_k, top_p))


def restrict_logits(logits: Tensor, keep: Tensor) -> Tensor:
    """``logits`` ``(..., V)`` outside the bool ``keep`` set at the dtype's lowest value (finite, unlike -inf).

    The PPO update restricts its teacher-forced logits to the kept set the sampler stored with each
    token, never to a set of its own: recomputed from other-precision logits, the set can leave out
    the sampled token (log π_old = −3.4e38 and a NaN update followed, under bf16).
    """
    return logits.masked_fill(~keep, torch.finfo(logits.dtype).min)


def kept_tokens(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """The bool ``(..., V)`` set of tokens top-k, then top-p (nucleus), keep from ``logits``.

    Ties at the k-th logit are kept, as Hugging Face's top-k does; the most likely token is always kept.
    """
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k is not None and top_k < logits.shape[-1]:
        keep &= logits >= logits.topk(top_k, dim=-1).values[..., -1:]  # (..., V) vs the k-th, (..., 1)
    if top_p is not None and top_p < 1:
        probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each one
        keep &= torch.zeros_like(keep).scatter(-1, order, before < top_p)
    return keep


def _check_truncation(top_k: int | None, top_p: float | None) -> None:
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be an int >= 1 or None (every token)")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} must be a float in (0, 1] or None (every token)")


class LMSampler:
    """Sample next tokens from a causal LM for N env slots, reading the env's observations.

    The policy keeps one KV-cache row per slot. It reads from each observation how many
    response tokens the slot holds: none means a new episode (prefill the prompt block), one
    more than it has consumed means feed that token. Any other case (a finished slot whose
    observation did not change, or a slot never started) feeds a filler token whose output is
    ignored; that row is rewritten at the slot's next reset.

    Args:
        model: a Hugging Face causal LM (its own device and dtype are used).
        num_slots: N, the env's ``num_envs`` (1 for a single env).
        prompt_len: the env's ``max_prompt_tokens``.
        max_len: the env's observation length.
        eos_token_id: filler for slots whose output is ignored.
        temperature: sampling temperature; 0 means greedy (a deterministic policy: the
            log-prob of its action is 0, so the KL reported against π_ref is −Σ log π_ref).
        generator: a ``torch.Generator`` for reproducible sampling.
        top_k, top_p: sample from the truncated distribution (see :func:`truncate_logits`; None: every
            token); the log-prob returned is under that distribution.
        seed: seeds a new generator when ``generator`` is None (without either, sampling draws from
            torch's global RNG: a run is reproducible only under ``torch.manual_seed``).
        decoder: the KV cache (:func:`textgym.ring_decoder.make_decoder`): ``ring`` (preallocated, fixed
            shapes), ``graph`` (the ring's step replayed as a CUDA graph; CUDA only), ``dynamic`` (a
            ``DynamicCache`` that grows a column per step), ``auto`` (the ring).
    """

    def __init__(
        self,
        model,
        num_slots: int,
        prompt_len: int,
        max_len: int,
        eos_token_id: int,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        decoder: str = "auto",
    ):
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0")
        _check_truncation(top_k, top_p)
        self.model = model
        self.prompt_len = prompt_len
        self.eos = eos_token_id
        self.temperature = temperature
        self.top_k, self.top_p = top_k, top_p
        self.decoder = make_decoder(decoder, model, num_slots, max_len)
        self.device = self.decoder.device
        if generator is None and seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        self.generator = generator
        self.fed = np.full(num_slots, -1, dtype=np.int64)  # response tokens consumed per slot
        self.last_kept: Tensor | None = None  # (N, W) packed support of the last act's distribution (truncating)

    @classmethod
    def for_env(cls, model, env, **kwargs) -> LMSampler:
        """Size the policy for a ``TextRLHFEnv`` or ``TextRLHFVectorEnv`` (wrapped or not)."""
        base = env.unwrapped
        return cls(
            model,
            getattr(base, "num_envs", 1),
            base.max_prompt_tokens,
            base.max_prompt_tokens + base.max_new_tokens,
            base.eos_token_id,
            **kwargs,
        )

    def reset(self) -> None:
        """Forget every slot's cache (the next observations start new episodes)."""
        self.decoder.reset()
        self.fed[:] = -1

    def release(self) -> None:
        """:meth:`reset`, and free the KV cache's memory until the next prefill (between rollouts)."""
        self.decoder.release()
        self.fed[:] = -1

    @torch.no_grad()
    def logits(self, obs: dict[str, np.ndarray | Tensor]) -> Tensor:
        """Next-token logits ``(N, V)`` for the observations ``(N, L)`` (or ``(L,)``).

        The bookkeeping runs on the host copy of the observation; only the N newest tokens (and
        the prompt block of slots that start) travel to the model's device.
        """
        n = len(self.fed)
        ids = np.asarray(obs["input_ids"]).reshape(n, -1)
        mask = np.asarray(obs["attention_mask"]).reshape(n, -1)
        resp_len = mask[:, self.prompt_len :].sum(1)
        new = np.flatnonzero((resp_len == 0) & (mask[:, : self.prompt_len].sum(1) > 0))  # not unstarted
        cont = resp_len == self.fed + 1
        # More than one new token: a partner's reply follows the policy's last one (TextMultiTurn-v0). The
        # row re-reads its whole conversation, as a prefill, instead of one cached step per token.
        reread = np.flatnonzero((self.fed >= 0) & (resp_len > self.fed + 1))
        out = None
        if self.decoder.started and (resp_len > 0).any():
            last = ids[np.arange(n), self.prompt_len + np.maximum(resp_len, 1) - 1]
            feed = np.where(cont, last, self.eos)
            out = self.decoder.step(torch.as_tensor(feed, device=self.device))
        for rows, (row_ids, row_mask) in ((new, (ids[new, : self.prompt_len], mask[new, : self.prompt_len])),
                                          (reread, context_rows(ids, mask, reread, self.prompt_len))):  # fmt: skip
            if not rows.size:
                continue
            slots = torch.as_tensor(rows, device=self.device)
            new_logits = self.decoder.prefill(slots, torch.as_tensor(row_ids, device=self.device),
                                              torch.as_tensor(row_mask, device=self.device))  # fmt: skip
            if out is None:
                out = new_logits.new_zeros(n, new_logits.shape[-1])
            out[slots] = new_logits
        if out is None:  # no slot started yet: nothing to compute, every action is ignored
            out = torch.zeros(n, self.model.get_output_embeddings().weight.shape[0], device=self.device)
        self.fed = np.where(resp_len == 0, 0, np.where(cont, resp_len, self.fed))
        self.fed[reread] = resp_len[reread]
        return out

    @property
    def truncates(self) -> bool:
        """Whether :meth:`act` samples from a top-k/top-p truncated distribution (and leaves its kept sets)."""
        return self.temperature > 0 and (self.top_k is not None or self.top_p is not None)

    @torch.no_grad()
    def act(self, obs: dict[str, np.ndarray | Tensor]) -> tuple[Tensor, Tensor]:
        """Sample one token per slot; return ``(actions (N,), log-probs (N,))`` under the policy that acts.

        The log-prob is that of the distribution the token was drawn from: the tempered (and top-k/top-p
        truncated) one, or for greedy decoding (temperature 0) the point mass, log 1 = 0. A truncating
        sampler also leaves that distribution's support in :attr:`last_kept`, packed by
        :func:`textgym.functional.pack_mask` ``(N, ceil(V / 8))``: the distribution is decided here,
        once, and the update reuses it (``collect_episodes`` stores it with each token).
        """
        logits = self.logits(obs)
        self.last_kept = None
        if self.temperature == 0:
            actions = logits.argmax(-1)
            return actions, torch.zeros(actions.shape, device=actions.device)
        logits = logits / self.temperature
        keep = kept_tokens(logits, self.top_k, self.top_p) if self.truncates else None
        logp = torch.log_softmax(logits if keep is None else restrict_logits(logits, keep), dim=-1)
        actions = sample_categorical(logp, self.generator)  # (N,)
        if keep is not None:
            self.last_kept = pack_mask(keep)
        return actions, logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
