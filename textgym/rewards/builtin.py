"""Built-in reward models: Hugging Face sequence classifiers, Python callables and VADER."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from textgym.functional import position_ids_from_mask
from textgym.models import _check_source, quiet_transformers, resolve_device, resolve_dtype
from textgym.rewards.base import Episodes, load_norm

__all__ = ["HFRewardModel", "CallableRewardModel", "VaderScorer"]


class HFRewardModel:
    """Any ``AutoModelForSequenceClassification`` folder or hub id, scoring prompt + response.

    With ``num_labels == 1`` the score is that logit (a Bradley–Terry reward model); with two
    or more it is the logit, or with ``use_logprob`` the log-probability, of ``label``.

    When the model's tokenizer is the environment's (same vocabulary), the episode's token ids
    are fed as they are; otherwise the text is re-tokenised with the model's own tokenizer.

    Args:
        source: folder or hub id.
        label: the class whose logit is the score when there are several (index or label name).
        use_logprob: score = log-softmax of the logits at ``label`` instead of the raw logit.
        batch_size: episodes per forward pass.
        device, dtype: where and in what precision to run (float32 on CPU by default).
    """

    def __init__(
        self,
        source: str | os.PathLike,
        label: int | str = 1,
        use_logprob: bool = False,
        batch_size: int = 64,
        device: str | torch.device | None = "cpu",
        dtype: str | torch.dtype | None = None,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        quiet_transformers()
        src = _check_source("reward_model", source)
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(src, dtype=resolve_dtype(dtype))
            self.tokenizer = AutoTokenizer.from_pretrained(src)
        except OSError as err:
            raise FileNotFoundError(
                f"reward_model={src!r} could not be loaded as a sequence classifier: {err}"
            ) from err
        self.model.to(resolve_device(device)).eval().requires_grad_(False)
        self.source = src
        self.name = Path(src).name if Path(src).exists() else src
        self.norm = load_norm(src) if Path(src).exists() else None
        self.batch_size = batch_size
        self.use_logprob = use_logprob
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
        if self.shares_tokenizer:
            return [p + r for p, r in zip(episodes.prompt_ids, episodes.response_ids)]
        texts = [p + r for p, r in zip(episodes.prompts, episodes.responses)]
        return self.tokenizer(texts)["input_ids"]

    @torch.no_grad()
    def score(self, episodes: Episodes) -> np.ndarray:
        ids = self._encode(episodes)
        device = next(self.model.parameters()).device
        out = []
        for start in range(0, len(ids), self.batch_size):
            chunk = ids[start : start + self.batch_size]
            width = max(len(x) for x in chunk)
            pad = self.model.config.pad_token_id
            # Left padding: the classifier pools the last non-pad token, the EOS when present.
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk], device=device)
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
