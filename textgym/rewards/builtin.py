"""Built-in reward models: Hugging Face sequence classifiers, Python callables and VADER."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from textgym.functional import position_ids_from_mask
from textgym.models import (
    check_finite_output,
    left_pad,
    load_pretrained,
    load_tokenizer,
    quiet_transformers,
    resolve_device,
)
from textgym.rewards.base import Episodes, load_norm

__all__ = ["CallableRewardModel", "HFRewardModel", "KeywordReward", "LengthReward", "VaderScorer"]


class HFRewardModel:
    """Any ``AutoModelForSequenceClassification`` folder or hub id, scoring prompt + response.

    With ``num_labels == 1`` the score is that logit (a Bradley–Terry reward model); with two
    or more it is the logit, or with ``use_logprob`` the log-probability, of ``label``. The
    input is prompt + response + EOS (the EOS appended when the episode reached the length cap), pooled
    at that last token, as ``textgym.rewards.training`` trains it.

    When the model's tokenizer is the environment's (same vocabulary), the episode's token ids
    are fed as they are; otherwise the text is re-tokenised with the model's own tokenizer.

    Args:
        source: folder or hub id.
        label: the class whose logit is the score when there are several (index or label name).
        use_logprob: score = log-softmax of the logits at ``label`` instead of the raw logit.
        include_prompt: score prompt + response (default) or the response alone (re-tokenised
            text; for a chat policy whose prompt is an instruction, not the start of the text).
        batch_size: episodes per forward pass.
        device, dtype: where and in what precision to run (float32 on CPU by default).
    """

    def __init__(
        self,
        source: str | os.PathLike,
        label: int | str = 1,
        use_logprob: bool = False,
        include_prompt: bool = True,
        batch_size: int = 64,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = None,
    ):
        from transformers import AutoModelForSequenceClassification

        quiet_transformers()
        # A causal-LM folder would load with a randomly initialised score head: refused by load_pretrained.
        self.model, src = load_pretrained(AutoModelForSequenceClassification, source, "reward_model",
                                          "a reward model (a sequence classifier)", dtype)  # fmt: skip
        self.tokenizer = load_tokenizer(src, name="reward_model", require_eos=False)
        self.model.to(resolve_device(device)).eval().requires_grad_(False)
        check_finite_output("reward_model", src, self.model)
        self.source = src
        self.name = Path(src).name if Path(src).exists() else src
        self.norm = load_norm(src) if Path(src).exists() else None
        self.batch_size = batch_size
        self.use_logprob = use_logprob
        self.include_prompt = bool(include_prompt)
        num_labels = self.model.config.num_labels
        if isinstance(label, str):
            label2id = self.model.config.label2id
            if label not in label2id:
                raise ValueError(f"label={label!r} is not one of the model's labels {sorted(label2id)}")
            label = label2id[label]
        if num_labels > 1 and not 0 <= label < num_labels:
            raise ValueError(f"label={label} is out of range for a model with {num_labels} labels")
        self.label = 0 if num_labels == 1 else label
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.shares_tokenizer = False

    def bind(self, tokenizer) -> None:
        """Called by the env with its tokenizer: reuse token ids when the vocabularies match."""
        self.shares_tokenizer = tokenizer.get_vocab() == self.tokenizer.get_vocab()

    @property
    def backbone(self) -> torch.nn.Module:
        """The transformer body under the classification head (for critic initialisation)."""
        return self.model.base_model

    def _encode(self, episodes: Episodes) -> list[list[int]]:
        """Token ids of prompt + response, always closed by one EOS (as in Bradley–Terry training).

        A response cut at the length cap is scored as if finished; the env's ``missing_eos_penalty`` is the
        place to discourage truncation.
        """
        eos = self.tokenizer.eos_token_id
        if self.shares_tokenizer and self.include_prompt:
            rows = [p + r for p, r in zip(episodes.prompt_ids, episodes.response_ids)]
        else:
            # text such as "<pad>" in a prompt or response is text, not the special token (as the env encodes it)
            texts = [(p if self.include_prompt else "") + r for p, r in zip(episodes.prompts, episodes.responses)]
            rows = self.tokenizer(texts, split_special_tokens=True)["input_ids"]
        if eos is None:
            return rows
        return [row if row and row[-1] == eos else [*row, eos] for row in rows]

    @torch.no_grad()
    def score(self, episodes: Episodes) -> np.ndarray:
        ids = self._encode(episodes)
        device = next(self.model.parameters()).device
        out = []
        for start in range(0, len(ids), self.batch_size):
            chunk = ids[start : start + self.batch_size]
            # Left padding: the classifier pools the last non-pad token, the EOS when present.
            input_ids, mask = (t.to(device) for t in left_pad(self.tokenizer, chunk))
            logits = self.model(
                input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
            ).logits.float()  # (b, num_labels)
            if self.use_logprob:
                logits = torch.log_softmax(logits, dim=-1)
            out.append(logits[:, self.label])
        return torch.cat(out).cpu().numpy()


class CallableRewardModel:
    """A plain Python function ``f(prompts, responses) -> sequence of float`` as a reward model."""

    shares_tokenizer = False

    def __init__(self, fn: Callable[[list[str], list[str]], Sequence[float]], name: str | None = None):
        if not callable(fn):
            raise TypeError(f"reward_model={fn!r} is not callable")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)

    def score(self, episodes: Episodes) -> Sequence[float]:
        return self.fn(list(episodes.prompts), list(episodes.responses))


class VaderScorer:
    """VADER compound sentiment of the response, in [-1, 1]: the default gold scorer.

    VADER (Hutto & Gilbert, 2014) is a lexicon and rule-based scorer; it plays the human
    labeller of the embedded task, whose preferences trained the proxy reward model.
    """

    name = "vader"
    shares_tokenizer = False

    def __init__(self, include_prompt: bool = False):
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.analyzer = SentimentIntensityAnalyzer()
        self.include_prompt = include_prompt

    def score_texts(self, texts: Sequence[str]) -> np.ndarray:
        return np.array([self.analyzer.polarity_scores(t)["compound"] for t in texts], dtype=np.float64)

    def score(self, episodes: Episodes) -> np.ndarray:
        if self.include_prompt:
            return self.score_texts([p + r for p, r in zip(episodes.prompts, episodes.responses)])
        return self.score_texts(episodes.responses)


class LengthReward:
    """−|response words − target| / target: highest (0) at the target length, in words or tokens."""

    shares_tokenizer = False

    def __init__(self, target: int = 20, unit: str = "words"):
        if not isinstance(target, int) or target < 1:
            raise ValueError(f"target={target!r} must be an int >= 1")
        if unit not in ("words", "tokens"):
            raise ValueError(f"unit={unit!r} is not one of 'words', 'tokens'")
        self.target, self.unit = target, unit
        self.name = f"length({target} {unit})"

    def score(self, episodes: Episodes) -> np.ndarray:
        if self.unit == "words":
            lengths = np.array([len(r.split()) for r in episodes.responses], dtype=np.float64)
        else:
            lengths = np.array([len(ids) for ids in episodes.response_ids], dtype=np.float64)
        return -np.abs(lengths - self.target) / self.target


class KeywordReward:
    """1 per keyword (or regex) found in the response, optionally capped; case-insensitive by default."""

    shares_tokenizer = False

    def __init__(self, keywords: Sequence[str] | str, regex: bool = False, case_sensitive: bool = False,
                 max_count: int | None = None):  # fmt: skip
        import re

        words = [keywords] if isinstance(keywords, str) else list(keywords)
        if not words or not all(isinstance(w, str) and w for w in words):
            raise ValueError(f"keywords={keywords!r} must be a non-empty str or list of non-empty str")
        flags = 0 if case_sensitive else re.IGNORECASE
        try:
            self.patterns = [re.compile(w if regex else r"\b" + re.escape(w) + r"\b", flags) for w in words]
        except re.error as err:
            raise ValueError(f"keywords={keywords!r}: invalid regular expression ({err})") from err
        self.max_count = max_count
        self.name = f"keywords({', '.join(words)})"

    def score(self, episodes: Episodes) -> np.ndarray:
        counts = np.array([sum(len(p.findall(r)) for p in self.patterns) for r in episodes.responses], dtype=float)
        return counts if self.max_count is None else np.minimum(counts, self.max_count)
