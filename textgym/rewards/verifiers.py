"""Verifiable rewards: the answer is checked, not learned (RLVR). A verifier is just a reward model.

``ArithmeticVerifier`` scores the embedded arithmetic task (``TextArithmetic-v0``): prompts
``"a+b="``, reward 1 for the exact sum (+ EOS), 0 otherwise. ``reward_model="arithmetic-proxy"`` is its
learned stand-in, a classifier of π_ref's right/wrong answers, to study over-optimisation against this exact
gold. Any other checker plugs in the same way (a function ``f(prompts, responses)`` or an object with
``score``); reasoning-gym's have a name of their own (:mod:`textgym.rewards.reasoning_gym_verifier`)::

    env = gym.make("TextRLHF-v0", prompts="reasoning-gym:basic_arithmetic",
                   reward_model="reasoning-gym:basic_arithmetic", normalize_reward=False)
"""

from __future__ import annotations

import re

import numpy as np

from textgym.arithmetic import Refused, calls, evaluate
from textgym.asset_paths import ARITH_PROXY_RM
from textgym.rewards.answers import committed_answer
from textgym.rewards.base import Episodes
from textgym.rewards.builtin import HFRewardModel
from textgym.rewards.registry import register

__all__ = ["AdditionAnswerVerifier", "ArithmeticVerifier", "CalculatorAnswerVerifier"]

_PROBLEM = re.compile(r"^\s*(-?\d+)\s*\+\s*(-?\d+)\s*=\s*$")


class ArithmeticVerifier:
    """1.0 when the response is exactly the sum asked by the prompt ``"a+b="``, else 0.0.

    Args:
        format_reward: added when the response is a bare integer, right or wrong (a small
            shaping term; default 0).

    Raises:
        ValueError: at scoring, a prompt that is not of the form ``"a+b="`` (it names the prompt).
    """

    name = "arithmetic"
    shares_tokenizer = False

    def __init__(self, format_reward: float = 0.0):
        if not isinstance(format_reward, (int, float)) or not np.isfinite(format_reward):
            raise ValueError(f"format_reward={format_reward!r} must be a finite float")
        self.format_reward = float(format_reward)

    def expected(self, prompt: str) -> str:
        match = _PROBLEM.match(prompt)
        if match is None:
            raise ValueError(f"prompt={prompt[:80]!r} is not an arithmetic problem of the form 'a+b='")
        return str(int(match.group(1)) + int(match.group(2)))

    def verdicts(self, episodes: Episodes) -> np.ndarray:
        """``(B,)`` bool: the response is exactly the sum (the score without its format shaping)."""
        return np.array(
            [r.strip() == self.expected(p) for p, r in zip(episodes.prompts, episodes.responses)], dtype=bool
        )

    def score(self, episodes: Episodes) -> np.ndarray:
        bare = np.array([bool(re.fullmatch(r"-?\d+", r.strip())) for r in episodes.responses])
        return self.verdicts(episodes).astype(np.float64) + self.format_reward * bare


register("arithmetic", lambda **kwargs: ArithmeticVerifier())

_ASKED_SUM = re.compile(r"(-?\d+)\s*\+\s*(-?\d+)")


class AdditionAnswerVerifier:
    """1.0 when a chat model's free-text response commits to the sum its prompt asks for, else 0.0.

    For a chat model asked in words (``"What is 37 + 48?"``): the sum is the prompt's first
    ``a + b``, the response's answer is the integer it commits to under the strict rules of
    :mod:`textgym.rewards.answers` (one stated answer, or one number that is not an operand; a
    response that lists or hedges commits to none and scores 0).

    Raises:
        ValueError: at scoring, a prompt with no ``a + b`` in it (it names the prompt).
    """

    name = "addition-answer"
    shares_tokenizer = False

    @staticmethod
    def operands(prompt: str) -> tuple[int, int]:
        match = _ASKED_SUM.search(prompt)
        if match is None:
            raise ValueError(f"prompt={prompt[:80]!r} asks for no sum of the form 'a + b'")
        return int(match.group(1)), int(match.group(2))

    def verdicts(self, episodes: Episodes) -> np.ndarray:
        """``(B,)`` bool: the response commits to the asked sum."""
        out = []
        for prompt, response in zip(episodes.prompts, episodes.responses):
            a, b = self.operands(prompt)
            out.append(committed_answer(response, (a, b)) == a + b)
        return np.array(out, dtype=bool)

    def score(self, episodes: Episodes) -> np.ndarray:
        return self.verdicts(episodes).astype(np.float64)


register("addition-answer", lambda **kwargs: AdditionAnswerVerifier())

_ASKED_EXPRESSION = re.compile(r"What is ([\d\s+\-*/()]*\d[\d\s+\-*/()]*)\?")


class CalculatorAnswerVerifier:
    """1.0 when the conversation's final answer is the value of the arithmetic its prompt asks for, else 0.0.

    For the calculator task (``partner="calculator"``, ``prompts="calculator-problems"``): the question is
    the prompt's *last* ``What is EXPRESSION?`` (an earlier one is the prompt's worked example), its value
    computed exactly by the calculator's own evaluator. The env hands a conversation's reward model the
    episode's *last* turn, so what is judged is the answer the policy gave, not the tool's ``<result>``
    (which is the partner's text): the integer that turn commits to under :mod:`textgym.rewards.answers`'
    strict rules, the expression's numbers not counting as answers.

    A last turn that still calls the tool is no answer and scores 0: the conversation ran out of turns (or
    tokens) before the policy answered. Why: GRPO on SmolLM2 found in four iterations that calling
    ``<calc>11033</calc>`` with the result until ``max_turns`` ends the episode was paid as the answer 11033
    (docs/multi-turn.md).

    Raises:
        ValueError: at scoring, a prompt with no ``What is EXPRESSION?`` or one whose value is not an integer
            (it names the prompt).
    """

    name = "calculator-answer"
    shares_tokenizer = False

    @staticmethod
    def question(prompt: str) -> tuple[int, tuple[int, ...]]:
        """(the asked value, the expression's own numbers) of ``prompt``."""
        asked = _ASKED_EXPRESSION.findall(prompt)
        try:
            value = evaluate(asked[-1]) if asked else None
        except Refused:  # 5 / 0, or no expression at all ("What is 5 5?"): the same sentence below
            value = None
        if not isinstance(value, int):
            raise ValueError(f"prompt={prompt[-80:]!r} asks no 'What is EXPRESSION?' with an integer value")
        return value, tuple(int(n) for n in re.findall(r"\d+", asked[-1]))

    def verdicts(self, episodes: Episodes) -> np.ndarray:
        """``(B,)`` bool: the final turn answers (calls no tool) and commits to the asked value."""
        out = []
        for prompt, response in zip(episodes.prompts, episodes.responses):
            value, operands = self.question(prompt)
            out.append(not calls(response) and committed_answer(response, operands) == value)
        return np.array(out, dtype=bool)

    def score(self, episodes: Episodes) -> np.ndarray:
        return self.verdicts(episodes).astype(np.float64)


register("calculator-answer", lambda **kwargs: CalculatorAnswerVerifier())


def _arithmetic_proxy(**kwargs) -> HFRewardModel:
    """The learned proxy of ``ArithmeticVerifier``; ``kwargs`` (the env's ``device``) go to HFRewardModel."""
    if not ARITH_PROXY_RM.is_dir():  # a source checkout without the built asset: say how to build it
        raise FileNotFoundError(
            f"reward_model='arithmetic-proxy': {str(ARITH_PROXY_RM)!r} does not exist; "
            "build it with `python -m textgym.assets.build_arith_proxy`"
        )
    return HFRewardModel(ARITH_PROXY_RM, **kwargs)


register("arithmetic-proxy", _arithmetic_proxy)
