"""TextRLHF-v0: token-level RLHF as a Gymnasium environment, single and natively vectorised."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

# Import the Llama classes the embedded models use now, not inside gym.make (≈3 s of imports).
from transformers.models.llama import modeling_llama  # noqa: F401

from textgym.envs.prompts import load_prompts
from textgym.models import (
    CachedDecoder,
    left_pad,
    load_causal_lm,
    load_tokenizer,
    pad_id_for,
    resolve_device,
)
from textgym.rewards import Episodes, RewardNorm, make_reward_model, score_checked
from textgym.utils import short_repr

__all__ = [
    "DEFAULT_KL_COEF",
    "TextRLHFEnv",
    "TextRLHFVectorEnv",
    "check_kl_coef",
    "load_prompts",
    "resolve_stop_ids",
]

DEFAULT_KL_COEF = 0.05  # β: the one default of the env, the PPO agent, the CLI and the benchmark
RENDER_MODES = ["ansi", "rgb_array"]
_IMPORT_PID = os.getpid()  # a process whose pid differs was forked after this module was imported


def _fork_safe_threads() -> None:
    """Run torch on one thread in a process forked after textgym was imported.

    Why: GNU OpenMP's thread pool does not survive ``fork``. Once the parent has run a parallel torch
    op, the child's first one waits forever for threads that exist only in the parent (Gymnasium's
    ``AsyncVectorEnv`` forks by default). With one thread torch never enters an OpenMP region; it is
    also what N worker processes on N cores want, and what torch's own DataLoader workers do.
    """
    if os.getpid() != _IMPORT_PID:
        torch.set_num_threads(1)


def _check_render_mode(render_mode: str | None) -> str | None:
    if render_mode is not None and render_mode not in RENDER_MODES:
        raise ValueError(f"render_mode={render_mode!r} is not one of {RENDER_MODES} or None")
    return render_mode


def text_image(text: str, height: int = 256, width: int = 512) -> np.ndarray:
    """``text`` drawn black on white as an ``(height, width, 3)`` uint8 frame (``render_mode="rgb_array"``).

    Why a picture of text: SB3's ``make_vec_env`` asks every env for ``rgb_array`` and video
    recorders take frames; a fixed size keeps every frame of a video the same. Long text keeps its
    last lines (the newest tokens).
    """
    import textwrap

    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    line_height = 12
    lines = [row for part in text.splitlines() or [""] for row in textwrap.wrap(part, width // 7) or [""]]
    lines = lines[-max(1, (height - 8) // line_height) :]
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((4, 4 + i * line_height), line, fill="black", font=font)
    return np.asarray(image, dtype=np.uint8)


def _check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or one ValueError naming it (bools are refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    return int(value)


def _check_nonnegative(name: str, value: Any) -> float:
    """``value`` as a finite float >= 0, or one ValueError naming it (bools and strings are refused)."""
    real = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not real or not np.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be a finite float >= 0")
    return float(value)


def check_kl_coef(value: Any, name: str = "kl_coef") -> float:
    """β as a finite float >= 0, or one ValueError naming it: the one check every entry point uses."""
    return _check_nonnegative(name, value)


def _check_vocabulary(model: Any, vocab_size: int, tokenizer) -> None:
    """Refuse a model with fewer output tokens than its tokenizer has ids: a prompt (or an EOS/PAD id) past
    the model's rows would fail later inside a forward with an IndexError. More rows than ids (a head
    padded to a multiple of 64) are fine: the env only reads the first ``vocab_size`` logits.
    """
    ids = len(tokenizer)
    if vocab_size < ids:
        raise ValueError(
            f"model={short_repr(str(model) if model is not None else 'the embedded LM')} has {vocab_size} output "
            f"tokens but its tokenizer has {ids} ids: token ids >= {vocab_size} have no row in the model; give the "
            "tokenizer the model was trained with (tokenizer=...), or resize the model's embeddings"
        )


def _check_options(options: Any) -> dict[str, Any]:
    """``reset``'s ``options`` as a dict ({} for None), or one TypeError naming it."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"options={short_repr(options)} must be a dict or None, e.g. {{'prompt': 'The movie was'}}")
    return options


def _check_timeout(value: Any) -> float | None:
    """``reward_timeout`` as seconds > 0, or None (no limit)."""
    if value is None:
        return None
    real = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not real or not np.isfinite(value) or value <= 0:
        raise ValueError(f"reward_timeout={value!r} must be a finite float > 0 (seconds) or None (no limit)")
    return float(value)


def _check_positions(name: str, model, needed: int, max_prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse episodes longer than the model's positions: it would run past what it was trained on."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and needed > limit:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} with max_prompt_tokens={max_prompt_tokens} needs {needed} positions "
            f"of {name}, more than its max_position_embeddings={limit}; allowed: max_new_tokens <= "
            f"{limit - (needed - max_new_tokens)} (or fewer max_prompt_tokens)"
        )


def resolve_stop_ids(model, tokenizer, stop_token_ids: Sequence[int] | None, vocab_size: int) -> frozenset[int]:
    """The token ids that end an episode.

    Default: the tokenizer's EOS plus every id of the model's ``generation_config.eos_token_id``
    (an int or a list: a chat model's end-of-turn is not the tokenizer's EOS). Given ids are
    used as they are, each checked to be a token id.
    """
    if stop_token_ids is None:
        ids = {int(tokenizer.eos_token_id)}
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids |= {int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])}
        return frozenset(i for i in ids if 0 <= i < vocab_size)
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (list, tuple, np.ndarray)):
        raise TypeError(f"stop_token_ids={stop_token_ids!r} must be a list of token ids or None (EOS + the model's)")
    ids = list(stop_token_ids)
    bad = [i for i in ids if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer))
           or not 0 <= i < vocab_size]  # fmt: skip
    if not ids or bad:
        raise ValueError(
            f"stop_token_ids={stop_token_ids!r} must be a non-empty list of token ids in [0, {vocab_size})"
        )
    return frozenset(int(i) for i in ids)


def _check_chat_template(chat_template: Any, tokenizer) -> bool:
    if not isinstance(chat_template, (bool, np.bool_)):
        raise TypeError(f"chat_template={chat_template!r} must be a bool")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"chat_template=True but tokenizer {tokenizer.name_or_path!r} has no chat template; "
            "give a chat model's tokenizer or chat_template=False (plain prompts)"
        )
    return bool(chat_template)


def _resolve_norm(normalize_reward: Any, reward_model, max_new_tokens: int) -> RewardNorm | None:
    """The (mean, std) the RM score is standardised with, or None; warns when measured at another length cap."""
    stored = getattr(reward_model, "norm", None)
    if stored is not None and not isinstance(stored, RewardNorm):  # a plug-in's plain (mean, std)
        stored = RewardNorm(*stored)
    if isinstance(normalize_reward, (tuple, list)):
        pair = normalize_reward
        ok = len(pair) == 2 and all(isinstance(v, (int, float)) and np.isfinite(v) for v in pair)
        if not ok or not normalize_reward[1] > 0:
            raise ValueError(f"normalize_reward={normalize_reward!r} must be a bool, None or a (mean, std > 0) pair")
        return RewardNorm(float(normalize_reward[0]), float(normalize_reward[1]), max_new_tokens)
    if normalize_reward is not None and not isinstance(normalize_reward, (bool, np.bool_)):
        raise ValueError(f"normalize_reward={normalize_reward!r} must be a bool, None or a (mean, std > 0) pair")
    if normalize_reward and stored is None:
        raise ValueError(
            f"normalize_reward=True but reward model {reward_model.name!r} has no stored mean/std; "
            "run `textgym rm-calibrate` on it, pass (mean, std) or normalize_reward=False"
        )
    if normalize_reward is False or stored is None:
        return None
    if stored.max_new_tokens not in (None, max_new_tokens):
        warnings.warn(
            f"reward model {reward_model.name!r}: its stored mean/std were measured under π_ref at "
            f"max_new_tokens={stored.max_new_tokens} (temperature {stored.temperature}), this env runs "
            f"max_new_tokens={max_new_tokens}, so π_ref's normalised score is not 0 here; run `textgym "
            f"rm-calibrate --max-new-tokens {max_new_tokens}` on it, or pass normalize_reward=(mean, std) or False "
            "(the env cannot see the agent's sampling temperature: calibrate at the one you sample at)",
            stacklevel=4,
        )
    return stored


class _Engine:
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
    ):
        _fork_safe_threads()
        max_new_tokens = _check_int("max_new_tokens", max_new_tokens, 1)
        if action_mask_top_p is not None and not (
            isinstance(action_mask_top_p, (int, float)) and 0 < action_mask_top_p <= 1
        ):
            raise ValueError(f"action_mask_top_p={action_mask_top_p!r} must be a float in (0, 1] or None")
        self.action_mask_top_p = action_mask_top_p
        missing_eos_penalty = _check_nonnegative("missing_eos_penalty", missing_eos_penalty)
        if max_prompt_tokens is not None:
            max_prompt_tokens = _check_int("max_prompt_tokens", max_prompt_tokens, 1)
        self.reward_timeout = _check_timeout(reward_timeout)
        self.device = resolve_device(device)
        self.kl_coef = kl_coef
        self.model = load_causal_lm(model, self.device, dtype, name="model")
        # without tokenizer= the model's folder must hold one: the error then names model=
        tok_arg = ("tokenizer", tokenizer) if tokenizer is not None else ("model", model)
        self.tokenizer = load_tokenizer(tok_arg[1], name=tok_arg[0])
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        _check_vocabulary(model, self.vocab_size, self.tokenizer)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.stop_ids = resolve_stop_ids(self.model, self.tokenizer, stop_token_ids, self.vocab_size)
        self.stop_array = np.array(sorted(self.stop_ids), dtype=np.int64)
        self.pad_id = pad_id_for(self.tokenizer, self.stop_ids)
        if self.tokenizer.pad_token_id is None:  # GPT-2 style: pad through the tokenizer with our PAD
            self.tokenizer.pad_token = self.tokenizer.convert_ids_to_tokens(self.pad_id)
        self.chat_template = _check_chat_template(chat_template, self.tokenizer)
        self.bos_id = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eos_id
        self.prompts = load_prompts(prompts, prompt_column)
        self.max_prompt_tokens = self._prompt_block(max_prompt_tokens)
        self.max_new_tokens = max_new_tokens
        self.seq_len = self.max_prompt_tokens + self.max_new_tokens
        self._check_prompt_room(max_new_tokens)
        _check_positions("model", self.model, self.seq_len, self.max_prompt_tokens, max_new_tokens)
        self.reward_model = self._bind(make_reward_model(reward_model, "reward_model", device=self.device))
        if getattr(self.reward_model, "shares_tokenizer", False) and hasattr(self.reward_model, "model"):
            # it scores prompt + response + the EOS closing a length-capped response
            _check_positions("reward_model", self.reward_model.model, self.seq_len + 1, self.max_prompt_tokens,
                             max_new_tokens)  # fmt: skip
        self.gold_scorer = None if gold_scorer is None else self._bind(make_reward_model(gold_scorer, "gold_scorer"))
        self.norm = _resolve_norm(normalize_reward, self.reward_model, max_new_tokens)
        self.missing_eos_penalty = missing_eos_penalty

        self.num_slots = num_slots
        n, L = num_slots, self.seq_len
        self.decoder = CachedDecoder(self.model, n, L)
        self.input_ids = np.full((n, L), self.pad_id, dtype=np.int64)
        self.attention_mask = np.zeros((n, L), dtype=np.int64)
        self.length = np.zeros(n, dtype=np.int64)  # response tokens so far
        self.started = np.zeros(n, dtype=bool)
        self.done = np.zeros(n, dtype=bool)
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
        encoded = [self.encode_prompt(p) for p in self.prompts]
        longest = max(len(e) for e in encoded)
        width = longest if max_prompt_tokens is None else max_prompt_tokens
        i = max(range(len(encoded)), key=lambda j: len(encoded[j]))
        self.longest_prompt = (i, longest)  # named by _check_prompt_room
        if longest > width:
            raise ValueError(
                f"prompts[{i}]={short_repr(self.prompts[i])} is {longest} tokens, more than "
                f"max_prompt_tokens={width}; prompts are never truncated"
            )
        return width

    def _check_prompt_room(self, max_new_tokens: int) -> None:
        """Refuse a prompt that leaves no room for the response in the model's positions, naming the prompt.

        Why here and not in :func:`_check_positions` alone: when the longest prompt fills every position,
        that check's bound on max_new_tokens is negative and points at the wrong argument.
        """
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        i, longest = self.longest_prompt
        if isinstance(limit, int) and longest >= limit:  # not even one response token fits
            raise ValueError(
                f"prompts[{i}]={short_repr(self.prompts[i])} is {longest} tokens; model has {limit} positions, so "
                f"with max_new_tokens={max_new_tokens} a prompt may be at most {limit - max_new_tokens} tokens "
                "(prompts are never truncated)"
            )

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

    def encode_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        """Token ids of ``prompts``, each checked to fit in ``max_prompt_tokens`` (never truncated).

        Raises:
            TypeError: a prompt is not a str.
            ValueError: a prompt is longer than ``max_prompt_tokens``.
        """
        encoded = [self.encode_prompt(p) for p in prompts]
        for p, ids in zip(prompts, encoded, strict=True):
            if len(ids) > self.max_prompt_tokens:
                raise ValueError(
                    f"prompt={short_repr(p)} is {len(ids)} tokens, more than "
                    f"max_prompt_tokens={self.max_prompt_tokens}; prompts are never truncated: give a shorter one "
                    "or build the env with a larger max_prompt_tokens"
                )
        return encoded

    def start(self, slots: list[int], prompts: list[str], encoded: list[list[int]] | None = None) -> None:
        """Begin episodes on ``slots``: write the prompts and prefill π_ref's cache with them.

        ``encoded`` is ``encode_prompts(prompts)`` when the caller has already checked them.
        Every check runs before any state changes: a refused start leaves the slots as they were.
        """
        if encoded is None:
            encoded = self.encode_prompts(prompts)
        P = self.max_prompt_tokens
        block_ids, block_mask = left_pad(self.tokenizer, encoded, P, "np", self.pad_id)  # (k, P)
        self.input_ids[slots] = self.pad_id
        self.attention_mask[slots] = 0
        self.input_ids[slots, :P], self.attention_mask[slots, :P] = block_ids, block_mask
        for row, slot in enumerate(slots):
            self.prompt_text[slot] = prompts[row]
        width = max(len(e) for e in encoded)  # π_ref prefills only the columns some prompt uses
        slot_t = torch.as_tensor(slots, device=self.device)
        logits = self.decoder.prefill(
            slot_t,
            torch.as_tensor(block_ids[:, P - width :], device=self.device),
            torch.as_tensor(block_mask[:, P - width :], device=self.device),
        )
        self._set_next(slot_t, logits)
        self.length[slots] = 0
        self.started[slots] = True
        self.done[slots] = False

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

        Returns a dict of (N,) arrays: reward, terminated, truncated, ref_logprob; and ``final``,
        a {slot: info} dict for the episodes that ended on this step.
        """
        n = len(actions)
        idx = np.flatnonzero(live)
        acts = torch.as_tensor(actions, device=self.device)
        ref_lp = np.zeros(n, dtype=np.float64)
        idx_t = torch.as_tensor(idx, device=self.device)
        ref_lp[idx] = (self.next_logits[idx_t, acts[idx_t]] - self.next_lse[idx_t]).double().cpu().numpy()
        col = self.max_prompt_tokens + self.length[idx]
        self.input_ids[idx, col] = actions[idx]
        self.attention_mask[idx, col] = 1
        self.length[idx] += 1
        # The length cap is a terminal state of this MDP, not an outside time limit: the observation
        # encodes the step and the score is paid there. `truncated` would make SB3 & co. bootstrap
        # γ·V(s_T) on top of the score. `truncated` stays False: it is for users' TimeLimit wrappers.
        stopped = np.zeros(n, dtype=bool)
        capped = np.zeros(n, dtype=bool)
        stopped[idx] = np.isin(actions[idx], self.stop_array)
        capped[idx] = ~stopped[idx] & (self.length[idx] >= self.max_new_tokens)
        ended = stopped | capped
        done_before = self.done.copy()
        self.done |= ended
        reward = self.kl_coef * ref_lp
        try:
            final = self._finish(np.flatnonzero(ended), capped, reward) if ended.any() else {}
            if (live & ~ended).any():
                feed = torch.where(torch.as_tensor(live & ~ended, device=self.device), acts, self.eos_id)
                self._set_next(slice(None), self.decoder.step(feed))  # restores its cache if it raises
        except BaseException:
            # Any failure, KeyboardInterrupt and a reward timeout included, leaves no half-applied step:
            # the token is undone so the step can be retried, and no slot is left done without its info.
            self.length[idx] -= 1
            self.input_ids[idx, col] = self.pad_id
            self.attention_mask[idx, col] = 0
            self.done = done_before
            raise
        return {
            "reward": reward,
            "terminated": ended,
            "truncated": np.zeros(n, dtype=bool),
            "ref_logprob": ref_lp,
            "final": final,
        }

    def _finish(self, slots: np.ndarray, capped: np.ndarray, reward: np.ndarray) -> dict[int, dict]:
        """Score the episodes ending now (one batched call per scorer) and add the end reward."""
        episodes = Episodes(
            prompts=[self.prompt_text[s] for s in slots],
            responses=[self.response_text(s) for s in slots],
            prompt_ids=[self.prompt_ids(s) for s in slots],
            response_ids=[self.response_ids(s) for s in slots],
        )
        named = [int(s) for s in slots] if self.num_slots > 1 else None  # errors name the slot, not the batch row
        rm = score_checked(self.reward_model, episodes, slots=named, timeout=self.reward_timeout)
        if self.gold_scorer is not None:
            gold = score_checked(self.gold_scorer, episodes, slots=named, timeout=self.reward_timeout)
        else:
            gold = np.full(len(slots), np.nan)
        score = (rm - self.norm[0]) / self.norm[1] if self.norm is not None else rm
        final = {}
        for k, s in enumerate(slots):
            penalty = self.missing_eos_penalty if capped[s] else 0.0
            reward[s] += score[k] - penalty
            # numpy scalars: TorchRL's info readers need a dtype (a float64 is also a Python float)
            final[int(s)] = {
                "rm_score": np.float64(rm[k]),
                "score_reward": np.float64(score[k]),
                "eos_penalty": np.float64(-penalty),
                "gold_score": np.float64(gold[k]),
                "prompt": episodes.prompts[k],
                "response": episodes.responses[k],
                "response_length": np.int64(self.length[s]),
                "length_capped": np.bool_(capped[s]),
            }
        return final

    def action_masks(self) -> np.ndarray:
        """``(N, V)`` bool: π_ref's top-p tokens at each slot's state (all True without ``action_mask_top_p``).

        The NLPO idea of RL4LMs (Ramamurthy et al., 2023): restrict the policy to tokens the
        reference model finds plausible. The smallest set whose π_ref mass reaches p is kept.
        """
        n = self.next_logits.shape[0]
        if self.action_mask_top_p is None:
            return np.ones((n, self.vocab_size), dtype=bool)
        probs = torch.softmax(self.next_logits, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above
        keep_sorted = before < self.action_mask_top_p  # the top token is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        return keep.cpu().numpy()

    def render(self, slot: int) -> str:
        return self.prompt_text[slot] + self.response_text(slot)


def _check_action(action: Any, vocab_size: int, name: str = "action") -> int:
    """A token id as a Python int, or one clear error naming the value and what is allowed."""
    if isinstance(action, np.ndarray) and action.shape == ():
        action = action.item()
    if isinstance(action, (bool, np.bool_)) or not isinstance(action, (int, np.integer)):
        raise TypeError(f"{name}={action!r} must be an integer token id in [0, {vocab_size})")
    if not 0 <= action < vocab_size:
        raise ValueError(f"{name}={action} is outside the action space: token ids are in [0, {vocab_size})")
    return int(action)


_DOC_ARGS = """
    Arguments:
        model: π_ref, a Hugging Face causal-LM folder or hub id (default: the embedded
            reference LM, a 4-layer Llama trained on short movie reviews).
        tokenizer: folder or id of the tokenizer (default: the model's).
        reward_model: r_φ: a registered name (``"default"``, ``"vader"``), an HF
            sequence-classifier folder or id, a ``"module:attr"`` string, an entry point of
            the ``textgym.reward_models`` group, an object with ``score(episodes)``, or a
            function ``f(prompts, responses) -> floats`` (default: the embedded RM).
        gold_scorer: the same routes; scores every finished episode beside the proxy RM for
            reward over-optimisation studies (default ``"vader"``; ``None`` turns it off).
        prompts: list of str, a UTF-8 ``.txt`` / ``.jsonl`` path, a folder saved with Hugging Face
            ``datasets``' ``save_to_disk``, or a dataset's name in the local Hugging Face cache
            (``"NAME"`` or ``"NAME:SPLIT"``; see :func:`load_prompts`) (default: the embedded train
            prompts; the eval prompts are ``textgym.assets.EVAL_PROMPTS``). Special-token text in
            a prompt (``"<pad>"``) is encoded as text, never as the special token.
        prompt_column: the field of a ``.jsonl`` row or a dataset holding the prompt (default ``"prompt"``).
        max_prompt_tokens: prompt block length (default: the longest prompt of the set).
            A longer prompt is refused with a ``ValueError``, never silently truncated.
        max_new_tokens: response length cap; reaching it terminates the episode (default 32).
            ``max_prompt_tokens + max_new_tokens`` must fit the model's ``max_position_embeddings``.
        kl_coef: β of the reward (default 0.05); settable between episodes (``env.kl_coef``).
        normalize_reward: standardise the RM score with the mean/std stored beside it (measured
            under π_ref; a warning says when at another ``max_new_tokens``); ``None`` (default)
            does so whenever stats are stored; a ``(mean, std)`` pair standardises with those.
        missing_eos_penalty: subtracted from the last reward when the episode reaches
            ``max_new_tokens`` without a stop token (default 0).
        action_mask_top_p: when set, ``action_masks()`` keeps only π_ref's top-p tokens (for
            sb3-contrib's MaskablePPO; NLPO of RL4LMs); default None keeps every token.
        stop_token_ids: the ids that end an episode (default: the tokenizer's EOS plus every
            id of the model's ``generation_config.eos_token_id``, e.g. a chat model's end-of-turn).
        chat_template: put each prompt into the tokenizer's chat template as the user turn,
            followed by the assistant's generation prompt (default False: plain text).
        device: ``"cpu"`` (default), ``"cuda"`` or ``"auto"``.
        dtype: π_ref's compute dtype, ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        reward_timeout: seconds to wait for each ``score`` call of the reward model and the gold
            scorer (default None: no limit); a call that hangs longer raises ``RewardModelError``
            naming the model and the batch, and is abandoned (a thread cannot be stopped).
"""


class TextRLHFEnv(gym.Env):
    __doc__ = (
        """Token-level RLHF: write the next token of a response to a prompt.

    Description:
        The KL-regularised RLHF objective of Ziegler et al. (2019) / Ouyang et al. (2022) as an
        MDP. The state is a prompt plus the tokens generated so far, the action the next
        token. π_ref (frozen SFT model) and r_φ (frozen reward model) live in the
        environment; the policy being trained is the agent.

    Action Space:
        ``Discrete(vocab_size)``: a token id.

    Observation Space:
        ``Dict(input_ids=Box(0, vocab_size - 1, (L,), int64), attention_mask=Box(0, 1, (L,),
        int64))`` with ``L = max_prompt_tokens + max_new_tokens``. The prompt is left-padded
        into the first ``max_prompt_tokens`` columns; response token k is at column
        ``max_prompt_tokens + k``; the mask is 1 on real tokens.

    Rewards:
        ``r_t = kl_coef · log π_ref(a_t | s_t)``, plus on the last step the reward-model score
        (normalised when ``normalize_reward``) minus ``missing_eos_penalty`` if length-capped.
        The reward depends on (s_t, a_t) only. An agent adding ``−kl_coef · log π(a_t|s_t)``
        of its own sample gets the per-token KL-penalised reward −β·log(π/π_ref) (+ score),
        whose return is that of E[score] − β·KL(π‖π_ref) (an entropy bonus β is not equivalent).
        ``info["ref_logprob"]`` is log π_ref(a_t | s_t) on every step.

    Starting State:
        A prompt drawn uniformly from ``prompts`` with ``self.np_random``, or
        ``reset(options={"prompt": text})``; the empty prompt starts from BOS. A prompt longer
        than ``max_prompt_tokens`` is refused with a ``ValueError`` before anything changes:
        the running episode, if any, steps on and the RNG is not re-seeded.

    Episode End:
        Terminated when the action is a stop token (EOS or any of the model's stop ids, see
        ``stop_token_ids``), and terminated at ``max_new_tokens`` tokens with
        ``info["length_capped"] = True``: the observation encodes the step and the score is paid
        there, so the cap is a terminal state of this MDP, not an outside time limit (an agent
        that bootstraps on ``truncated`` would add V(s_T) on top of the score). ``truncated`` is
        always False; it is left to outside time limits such as a user's ``TimeLimit``. The last
        step's info adds ``rm_score`` (raw), ``score_reward``, ``eos_penalty``, ``gold_score``,
        ``prompt``, ``response``, ``response_length`` and ``length_capped``. A reward model that
        raises, hangs past ``reward_timeout`` or returns anything but one finite float per
        episode raises :class:`textgym.rewards.RewardModelError` naming it, the batch and the
        episode's slot. Any exception in a step (``KeyboardInterrupt`` too, re-raised as it is)
        undoes the step, so it can be retried.
"""
        + _DOC_ARGS
        + """
    Vectorized Environment:
        ``gym.make_vec("TextRLHF-v0", num_envs=N, vectorization_mode="vector_entry_point")``
        gives :class:`TextRLHFVectorEnv`: one batched cached π_ref forward per step for all N
        slots and one batched RM call for the episodes ending on that step.

    Rendering:
        ``render_mode="ansi"`` returns the prompt and response so far as text, ``"rgb_array"`` that
        text drawn black on white as a ``(256, 512, 3)`` uint8 frame (for video recorders).

    Processes:
        ``gym.make_vec(..., vectorization_mode="async")`` works with the default ``fork`` start
        method: an env built in a process forked after ``import textgym`` sets torch to one thread
        (GNU OpenMP's pool does not survive fork), as torch's DataLoader workers do. One env per
        process then uses one core; ``torch.set_num_threads`` after ``make`` overrides it.

    Version History:
        v0: initial release. Changed before any release, keeping the id: reaching
            ``max_new_tokens`` is ``terminated`` with ``info["length_capped"]`` (it was
            ``truncated``); any of the model's stop ids ends an episode; ``chat_template``;
            with autoreset disabled a finished slot ignores its action (it raised); special-token
            text in prompts is encoded as text (it was parsed); ``reward_timeout``; ``render_mode=
            "rgb_array"`` draws the text as a frame (SB3's ``make_vec_env`` asks for it); numeric infos are
            numpy scalars (TorchRL's info readers need a dtype; a ``float64`` is still a Python float); in a
            process forked after textgym's import, torch runs on one thread (``AsyncVectorEnv`` hung).

    Example:
        >>> import gymnasium as gym, textgym
        >>> env = gym.make("TextRLHF-v0", max_new_tokens=4)
        >>> obs, info = env.reset(seed=0, options={"prompt": "The movie was"})
        >>> obs["input_ids"].shape == env.observation_space["input_ids"].shape
        True
        >>> obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
        >>> bool(np.isclose(reward, env.unwrapped.kl_coef * info["ref_logprob"])) or terminated
        True
    """
    )

    metadata = {"render_modes": RENDER_MODES, "render_fps": 4}

    def __init__(self, render_mode: str | None = None, **kwargs: Any):
        self.render_mode = _check_render_mode(render_mode)
        self._engine = _Engine(1, **kwargs)
        e = self._engine
        self.action_space = spaces.Discrete(e.vocab_size)
        self.observation_space = spaces.Dict(
            {
                "input_ids": spaces.Box(0, e.vocab_size - 1, (e.seq_len,), np.int64),
                "attention_mask": spaces.Box(0, 1, (e.seq_len,), np.int64),
            }
        )

    # Models and settings are the engine's; expose the ones users and agents read.
    model = property(lambda self: self._engine.model)
    tokenizer = property(lambda self: self._engine.tokenizer)
    reward_model = property(lambda self: self._engine.reward_model)
    gold_scorer = property(lambda self: self._engine.gold_scorer)
    prompts = property(lambda self: self._engine.prompts)
    max_prompt_tokens = property(lambda self: self._engine.max_prompt_tokens)
    max_new_tokens = property(lambda self: self._engine.max_new_tokens)
    eos_token_id = property(lambda self: self._engine.eos_id)
    stop_token_ids = property(lambda self: tuple(sorted(self._engine.stop_ids)), doc="ids that end an episode")
    pad_token_id = property(lambda self: self._engine.pad_id)
    kl_coef = property(lambda self: self._engine.kl_coef, lambda self, v: setattr(self._engine, "kl_coef", v), doc="β")
    reference_context = property(
        lambda self: self._engine.decoder.context,
        lambda self, factory: setattr(self._engine.decoder, "context", factory),
        doc="π_ref's forwards run inside ``reference_context()`` (default: nothing). A LoRA policy built on "
        "the env's own model (``peft.get_peft_model(env.unwrapped.model, ...)``) shares π_ref's weights; "
        "set it to ``policy.disable_adapter`` and π_ref stays the base model.",
    )

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        options = _check_options(options)
        prompt = options.get("prompt")
        # Check a given prompt before seeding: a refused reset changes nothing, the running
        # episode (if any) steps on and the RNG keeps its state.
        encoded = self._engine.encode_prompts([prompt]) if prompt is not None else None
        super().reset(seed=seed)
        if prompt is None:
            prompt = self._engine.prompts[int(self.np_random.integers(len(self._engine.prompts)))]
        self._engine.start([0], [prompt], encoded)
        return self._engine.observation(0), {"prompt": prompt}

    def step(self, action):
        e = self._engine
        if not e.started[0]:
            raise RuntimeError("step() called before reset(); call env.reset() first")
        if e.done[0]:
            raise RuntimeError("step() called after the episode ended (terminated or truncated); call env.reset()")
        a = _check_action(action, e.vocab_size)
        out = e.advance(np.array([a], dtype=np.int64), np.ones(1, dtype=bool))
        info = {"ref_logprob": np.float64(out["ref_logprob"][0]), **out["final"].get(0, {})}
        return e.observation(0), float(out["reward"][0]), bool(out["terminated"][0]), bool(out["truncated"][0]), info

    def action_masks(self) -> np.ndarray:
        """``(vocab_size,)`` bool mask of the allowed tokens (see ``action_mask_top_p``)."""
        return self._engine.action_masks()[0]

    def render(self) -> str | np.ndarray | None:
        """The prompt and response so far: text (``"ansi"``) or that text drawn as a frame (``"rgb_array"``)."""
        if self.render_mode == "ansi":
            return self._engine.render(0)
        if self.render_mode == "rgb_array":
            return text_image(self._engine.render(0))
        return None


_AUTORESET = {
    **{m: m for m in AutoresetMode},
    "next_step": AutoresetMode.NEXT_STEP,
    "same_step": AutoresetMode.SAME_STEP,
    "disabled": AutoresetMode.DISABLED,
}


class TextRLHFVectorEnv(VectorEnv):
    __doc__ = (
        """N episode slots of :class:`TextRLHFEnv` stepped together.

    Every step runs one batched, KV-cached π_ref forward over all N slots and one batched
    reward-model call for the episodes that end on it; slots finish at different steps.

    Autoreset (``autoreset_mode``, declared in ``metadata["autoreset_mode"]``):
        ``"next_step"`` (Gymnasium's default): a finished slot is reset on the next ``step``,
        whose action for it is ignored (reward 0). ``"same_step"``: reset at once, the final
        observation and info in ``info["final_obs"]`` / ``info["final_info"]``.
        ``"disabled"``: finished slots wait for ``reset(options={"reset_mask": mask})``;
        stepping one ignores its action (reward 0, not terminated; what TorchRL's ``GymWrapper``
        and :func:`textgym.episodes.collect_episodes` use).

    Seeding matches ``SyncVectorEnv``: ``reset(seed=s)`` seeds slot i with ``s + i``.
    ``reset(options={"prompt": str | list[str]})`` sets the prompts of the reset slots.
"""
        + _DOC_ARGS
        + """        num_envs: number of slots N.
        autoreset_mode: see above (an ``AutoresetMode`` or its string value).
    """
    )

    metadata = {"render_modes": RENDER_MODES, "render_fps": 4, "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        num_envs: int = 1,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        render_mode: str | None = None,
        **kwargs: Any,
    ):
        _check_int("num_envs", num_envs, 1)
        mode = _AUTORESET.get(autoreset_mode.lower() if isinstance(autoreset_mode, str) else autoreset_mode)
        if mode is None:
            raise ValueError(f"autoreset_mode={autoreset_mode!r} is not one of {sorted(_AUTORESET, key=str)}")
        self.render_mode = _check_render_mode(render_mode)
        self.metadata = {**type(self).metadata, "autoreset_mode": mode}
        self.num_envs = int(num_envs)
        self._engine = _Engine(self.num_envs, **kwargs)
        e = self._engine
        self.single_action_space = spaces.Discrete(e.vocab_size)
        self.single_observation_space = spaces.Dict(
            {
                "input_ids": spaces.Box(0, e.vocab_size - 1, (e.seq_len,), np.int64),
                "attention_mask": spaces.Box(0, 1, (e.seq_len,), np.int64),
            }
        )
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self._slot_rngs = [seeding.np_random()[0] for _ in range(self.num_envs)]
        self._autoreset = np.zeros(self.num_envs, dtype=bool)

    def rng_state(self) -> list[dict]:
        """The per-slot prompt RNG states (for exact resumption of a training run)."""
        return [rng.bit_generator.state for rng in self._slot_rngs]

    def set_rng_state(self, state: list[dict]) -> None:
        if len(state) != self.num_envs:
            raise ValueError(f"state has {len(state)} slot RNG states for num_envs={self.num_envs}")
        for rng, st in zip(self._slot_rngs, state, strict=True):
            rng.bit_generator.state = st

    @property
    def autoreset_mode(self) -> AutoresetMode:
        """The autoreset mode (also in ``metadata``; TorchRL's GymWrapper reads this attribute)."""
        return self.metadata["autoreset_mode"]

    model = TextRLHFEnv.model
    tokenizer = TextRLHFEnv.tokenizer
    reward_model = TextRLHFEnv.reward_model
    gold_scorer = TextRLHFEnv.gold_scorer
    prompts = TextRLHFEnv.prompts
    max_prompt_tokens = TextRLHFEnv.max_prompt_tokens
    max_new_tokens = TextRLHFEnv.max_new_tokens
    eos_token_id = TextRLHFEnv.eos_token_id
    stop_token_ids = TextRLHFEnv.stop_token_ids
    pad_token_id = TextRLHFEnv.pad_token_id
    kl_coef = TextRLHFEnv.kl_coef
    reference_context = TextRLHFEnv.reference_context

    def draw_prompts(self, slots) -> list[str]:
        """One prompt per slot in ``slots``, drawn with that slot's RNG as its reset would.

        For groups of G episodes on one prompt (GRPO, RLOO): draw with one slot per group and
        pass each prompt G times to ``reset(options={"prompt": ...})``. Seeded and checkpointed
        with the slots' RNGs (``rng_state``).
        """
        e = self._engine
        return [e.prompts[int(self._slot_rngs[int(s)].integers(len(e.prompts)))] for s in slots]

    def _start(self, slots: np.ndarray) -> None:
        """Start ``slots`` on prompts drawn with their own RNGs."""
        self._engine.start(slots.tolist(), self.draw_prompts(slots))

    def _given_prompts(self, prompts: Any, n: int) -> list[str]:
        """``options["prompt"]`` as one prompt per slot being reset, or one clear error."""
        if isinstance(prompts, str):
            return [prompts] * n
        if not isinstance(prompts, (list, tuple, np.ndarray)) or len(prompts) != n:
            raise ValueError(
                f"options['prompt']={short_repr(prompts)} must be a str or a list of {n} str, one per slot being reset"
            )
        return list(prompts)

    def _seeds(self, seed: Any) -> list[int | None]:
        """``seed`` as one seed (or None) per slot: an int s seeds slot i with s + i; each one checked here."""
        n = self.num_envs
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
            seeds = [int(seed) + i for i in range(n)]
        else:
            seeds = list(seed) if isinstance(seed, (list, tuple, np.ndarray)) and len(seed) == n else None
        if seeds is None or not all(s is None or (isinstance(s, (int, np.integer)) and s >= 0) for s in seeds):
            raise ValueError(f"seed={short_repr(seed)} must be an int, None or a list of {n} int/None (ints >= 0)")
        return [None if s is None else int(s) for s in seeds]

    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None):
        options = _check_options(options)
        mask = options.get("reset_mask")
        if mask is None:
            mask = np.ones(self.num_envs, dtype=bool)
        mask = np.asarray(mask)
        if mask.shape != (self.num_envs,) or mask.dtype != np.bool_:
            raise ValueError(f"options['reset_mask'] must be a bool array of shape ({self.num_envs},), got {mask!r}")
        slots = np.flatnonzero(mask)
        # Every check before any change: a refused reset leaves the slots and their RNGs as they were.
        seeds = self._seeds(seed) if seed is not None else None
        given, encoded = None, None
        if options.get("prompt") is not None and slots.size:
            given = self._given_prompts(options["prompt"], len(slots))
            encoded = self._engine.encode_prompts(given)
        if seeds is not None:
            super().reset(seed=seeds[0])
            for i in slots:
                if seeds[i] is not None:
                    self._slot_rngs[i] = seeding.np_random(int(seeds[i]))[0]
        if given is not None:
            self._engine.start(slots.tolist(), given, encoded)
        elif slots.size:
            self._start(slots)
        self._autoreset[slots] = False
        info: dict[str, Any] = {}
        for s in slots:
            info = self._add_info(info, {"prompt": self._engine.prompt_text[s]}, int(s))
        return self._engine.observation(slice(None)), info

    def step(self, actions):
        e = self._engine
        actions = np.asarray(actions)
        if actions.shape != (self.num_envs,) or not np.issubdtype(actions.dtype, np.integer):
            raise ValueError(
                f"actions={actions!r} must be an integer array of shape ({self.num_envs},) "
                f"with token ids in [0, {e.vocab_size})"
            )
        mode = self.metadata["autoreset_mode"]
        # With autoreset disabled a slot waits (its action ignored) until it is reset: never started ones too.
        unstarted = ~e.started.any() if mode == AutoresetMode.DISABLED else ~e.started.all()
        if unstarted:
            raise RuntimeError("step() called before reset() for some slots; call envs.reset() first")
        if mode == AutoresetMode.DISABLED and not (e.started & ~e.done).any():
            raise RuntimeError(
                "step() called with every slot finished and autoreset disabled; "
                "reset them with reset(options={'reset_mask': mask})"
            )
        bad = np.flatnonzero((actions < 0) | (actions >= e.vocab_size))
        if bad.size:
            raise ValueError(
                f"actions[{bad[0]}]={actions[bad[0]]} is outside the action space: token ids are in [0, {e.vocab_size})"
            )
        resetting = self._autoreset.copy() if mode == AutoresetMode.NEXT_STEP else np.zeros(self.num_envs, bool)
        # With autoreset disabled a finished slot waits for reset(options={"reset_mask": ...}): its
        # action is ignored, as on NEXT_STEP's reset step (reward 0, not terminated, "_ref_logprob" False).
        live = e.started & ~e.done & ~resetting
        out = e.advance(actions.astype(np.int64), live)
        ended = out["terminated"] | out["truncated"]
        if resetting.any():
            self._start(np.flatnonzero(resetting))
        # Per-step info as whole arrays (one _add_info call per slot costs ~0.1 ms each at N=64).
        shown = live & ~ended if mode == AutoresetMode.SAME_STEP else live
        info: dict[str, Any] = {"ref_logprob": np.where(shown, out["ref_logprob"], 0.0), "_ref_logprob": shown}
        if mode == AutoresetMode.SAME_STEP and ended.any():
            # As SyncVectorEnv: the finished slot's last obs and info go under final_obs/final_info.
            slots = np.flatnonzero(ended)
            final_obs = e.observation(slots)
            for row, s in enumerate(slots):
                info = self._add_info(info, {"final_obs": {k: v[row] for k, v in final_obs.items()}}, int(s))
            finals = {int(s): {"ref_logprob": out["ref_logprob"][s], **out["final"][int(s)]} for s in slots}
            info["final_info"], info["_final_info"] = _batched_infos(finals, self.num_envs), ended.copy()
            self._start(slots)
            info.update(_batched_infos({int(s): {"prompt": e.prompt_text[s]} for s in slots}, self.num_envs))
        else:
            info.update(_batched_infos(out["final"], self.num_envs))
        self._autoreset = ended if mode == AutoresetMode.NEXT_STEP else np.zeros(self.num_envs, bool)
        return (
            e.observation(slice(None)),
            out["reward"],
            out["terminated"],
            out["truncated"],
            info,
        )

    def action_masks(self) -> np.ndarray:
        """``(num_envs, vocab_size)`` bool masks of the allowed tokens (see ``action_mask_top_p``)."""
        return self._engine.action_masks()

    def render(self) -> tuple[str, ...] | tuple[np.ndarray, ...] | None:
        """One rendering per slot, as :meth:`TextRLHFEnv.render` (``SyncVectorEnv`` also returns a tuple)."""
        if self.render_mode == "ansi":
            return tuple(self._engine.render(i) for i in range(self.num_envs))
        if self.render_mode == "rgb_array":
            return tuple(text_image(self._engine.render(i)) for i in range(self.num_envs))
        return None


def _batched_infos(per_slot: dict[int, dict[str, Any]], num_envs: int) -> dict[str, np.ndarray]:
    """Per-slot infos in Gymnasium's vector layout: one ``(N,)`` array per key and its ``_key`` mask.

    Why not ``VectorEnv._add_info``: it turns a ``np.bool_`` into an object array; here every
    numpy scalar keeps its dtype (what TorchRL's info readers take), text goes in object arrays.
    """
    out: dict[str, np.ndarray] = {}
    for slot, info in per_slot.items():
        for key, value in info.items():
            if key not in out:
                numeric = isinstance(value, (np.generic, bool, int, float)) and not isinstance(value, np.str_)
                out[key] = np.zeros(num_envs, np.asarray(value).dtype) if numeric else np.full(num_envs, None, object)
                out[f"_{key}"] = np.zeros(num_envs, dtype=bool)
            out[key][slot] = value
            out[f"_{key}"][slot] = True
    return out
