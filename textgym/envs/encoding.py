"""Text to π_ref's tokens and back: the tokenizer, its special ids, the chat template and the prompt block."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from textgym.envs.checks import check_chat_template, check_vocabulary, resolve_stop_ids
from textgym.errors import short_repr
from textgym.models import load_tokenizer, pad_id_for

__all__ = ["Encoding", "opening_margin"]


def opening_margin(longest: int) -> int:
    """Columns the prompt block keeps beyond the longest probed opening: max(16, 1/8 of it).

    Why: a game's opening varies with the seed (a board, a hand, a word list) and episodes draw seeds
    below 2**30; probing them all is out of reach (RushHour resets in 0.47 s). Over seeds 0-199 with
    SmolLM2's chat template the longest opening of each offline TextArena game exceeded the longest of
    seeds 0-3 by at most 12 tokens (1.3 %; docs/multi-turn.md): the margin covers 4x that.
    """
    return max(16, longest // 8)


class Encoding:
    """The tokenizer of π_ref and the ids an episode needs from it (EOS, stops, PAD, BOS), the chat template,
    and the prompt block's width ``block`` (``max_prompt_tokens``, set by :meth:`size_block`)."""

    def __init__(self, model, model_arg, tokenizer_arg, stop_token_ids, chat_template: bool):
        # without tokenizer= the model's folder must hold one: the error then names model=
        name, source = ("tokenizer", tokenizer_arg) if tokenizer_arg is not None else ("model", model_arg)
        self.tokenizer = load_tokenizer(source, name=name)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        check_vocabulary(model_arg, self.vocab_size, self.tokenizer)
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.stop_ids = resolve_stop_ids(model, self.tokenizer, stop_token_ids, self.vocab_size)
        self.stop_array = np.array(sorted(self.stop_ids), dtype=np.int64)
        self.pad_id = pad_id_for(self.tokenizer, self.stop_ids)
        if self.tokenizer.pad_token_id is None:  # GPT-2 style: pad through the tokenizer with our PAD
            self.tokenizer.pad_token = self.tokenizer.convert_ids_to_tokens(self.pad_id)
        self.chat_template = check_chat_template(chat_template, self.tokenizer)
        self.bos_id = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eos_id
        self.block = 0
        self.longest: tuple[tuple[str, str], int] = (("prompt", ""), 0)  # the longest text sized for, its tokens

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

    def encode_prompts(self, prompts: Sequence[str], names: Sequence[str] | None = None) -> list[list[int]]:
        """Token ids of ``prompts``, each checked to fit in the prompt block (never truncated).

        ``names``: what each prompt is, for the error (default ``prompt``; a partner's opening names its seed).

        Raises:
            TypeError: a prompt is not a str.
            ValueError: a prompt is longer than ``max_prompt_tokens``.
        """
        encoded = [self.encode_prompt(p) for p in prompts]
        for k, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
            if len(ids) > self.block:
                raise ValueError(
                    f"{'prompt' if names is None else names[k]}={short_repr(p)} is {len(ids)} tokens, more than "
                    f"max_prompt_tokens={self.block}; prompts are never truncated: give a shorter one "
                    f"or build the env with max_prompt_tokens >= {len(ids)} (textgym train --max-prompt-tokens)"
                )
        return encoded

    def size_block(self, texts: list[tuple[str, str]], openings: int, max_prompt_tokens: int | None) -> int:
        """The prompt block's width: the longest of ``texts`` ((name, text) pairs, the last ``openings`` of them a
        partner's openings), with a margin for other seeds' openings; or the width given if every text fits."""
        encoded = [self.encode_prompt(p) for _, p in texts]
        longest = max(len(e) for e in encoded)
        width = longest if max_prompt_tokens is None else max_prompt_tokens
        if max_prompt_tokens is None and openings:  # room for other seeds' openings
            width = longest + opening_margin(longest)
        i = max(range(len(encoded)), key=lambda j: len(encoded[j]))
        self.longest = (texts[i], longest)
        if longest > width:
            raise ValueError(
                f"{texts[i][0]}={short_repr(texts[i][1])} is {longest} tokens, more than "
                f"max_prompt_tokens={width}; prompts are never truncated"
            )
        self.block = width
        return width

    def text(self, ids: list[int]) -> str:
        """The text of ``ids`` as scorers and partners read it: stop tokens and special tokens left out."""
        return self.tokenizer.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=True)
