"""A reasoning-gym dataset's own checker as the reward model: ``reward_model="reasoning-gym:<dataset>"``.

The spec, the splits and their regeneration are :mod:`textgym.reasoning_gym_task`'s; this is the reward model
that pays ``score_answer`` for the entry whose question is the episode's prompt, and says which episodes solved it.
"""

from __future__ import annotations

import numpy as np

from textgym.reasoning_gym_task import (
    EVAL_SEED,
    EVAL_SIZE,
    TRAIN_SEED,
    TRAIN_SIZE,
    dataset_object,
    parse_spec,
    split_entries,
)
from textgym.rewards.base import Episodes

__all__ = ["ReasoningGymVerifier"]


class ReasoningGymVerifier:
    """A reasoning-gym dataset's ``score_answer`` as the reward model; its verdict is full credit.

    Args:
        spec: ``"reasoning-gym:<dataset>[?options]"`` (a ``:eval`` is the same verifier: it knows both splits).
        argument: the argument named in errors (``reward_model`` or ``gold_scorer``).

    Raises:
        ValueError: a bad spec; at scoring, a prompt that is no question of either split (naming it).
    """

    shares_tokenizer = False

    def __init__(self, spec: str, argument: str = "reward_model"):
        parsed = parse_spec(spec, argument)
        self.spec = parsed._replace(split="train")
        self.name = self.spec.name()
        self.argument = argument
        self._data = dataset_object(self.spec)  # its score_answer
        self._entries = {e["question"]: e for e in split_entries(self.spec)}
        self._eval_added = False
        self._last: tuple[tuple, np.ndarray] | None = None  # the last batch's scores: verdicts follows score

    def entry(self, prompt: str) -> dict:
        """The dataset entry whose question is ``prompt``, or one ValueError naming the prompt and the spec."""
        entry = self._entries.get(prompt)
        if entry is None and not self._eval_added:
            # the held-out entries only once a prompt asks for them: a slow dataset (futoshiki, ...) takes a
            # minute per thousand puzzles, and a training run never needs them
            held_out = split_entries(self.spec._replace(split="eval"))
            self._entries |= {e["question"]: e for e in held_out}
            self._eval_added = True
            entry = self._entries.get(prompt)
        if entry is None:
            raise ValueError(
                f"{self.argument}={self.name!r}: prompt={prompt[:80]!r} is no question of its train split (seed "
                f"{TRAIN_SEED}, {TRAIN_SIZE} draws) or eval split (seed {EVAL_SEED}, {EVAL_SIZE} draws); give "
                f"prompts={self.name!r} or {self.spec._replace(split='eval').name()!r}, with the same options"
            )
        return entry

    def scores(self, prompts: list[str], responses: list[str]) -> np.ndarray:
        """``(B,)`` float64: ``score_answer(response.strip(), entry)``; a scorer that raises scores 0.

        Why catch: some reasoning-gym scorers raise on an answer they cannot parse instead of scoring it 0
        (0.1.25: boxnet, game_of_life, prime_factorization); a policy's malformed answer is a wrong answer.
        """
        out = np.zeros(len(prompts), dtype=np.float64)
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            entry = self.entry(prompt)
            try:
                out[i] = float(self._data.score_answer(response.strip(), entry))
            except Exception:  # noqa: BLE001 (see the docstring)
                out[i] = 0.0
        return out

    def score(self, episodes: Episodes) -> np.ndarray:
        return self._scores_of(episodes).copy()

    def verdicts(self, episodes: Episodes) -> np.ndarray:
        """``(B,)`` bool: the answer got full credit (score 1.0); partial credit is not a solve."""
        return self._scores_of(episodes) >= 1.0

    def _scores_of(self, episodes: Episodes) -> np.ndarray:
        """:meth:`scores` of the batch, once: the env asks for the verdicts of the batch it has just scored, and
        some reasoning-gym scorers are slow (they parse or simulate the answer)."""
        key, last = (tuple(episodes.prompts), tuple(episodes.responses)), self._last  # read once: an abandoned
        if last is None or last[0] != key:  # call (reward_timeout) may still be writing from its thread
            last = self._last = (key, self.scores(episodes.prompts, episodes.responses))
        return last[1]
