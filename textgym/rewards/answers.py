"""Exact-answer checking for chat models: which integer a free-text response commits to.

A chat model asked "What is 37 + 48?" answers in prose ("37 + 48 = 85.", "The answer is 85",
"**Answer: 85**"), so the checker must find the answer in the text; and whatever it accepts,
RL will find. So the rules are strict and a response that hedges gets nothing:

1. **Stated answers.** ``Answer: N``, ``answer is N``, ``answer = N`` and ``\\boxed{N}`` (any
   case) state an answer. If a response states one or more, every statement must name the same
   N, and nothing after a statement on its line may be another number (``Answer: 85, 86`` is a
   list, not an answer). Work shown before the statement is allowed.
2. **Otherwise, one number.** The answer is the response's only number that is not an operand
   of the question (``37 + 48 = 85`` commits to 85). Two or more such numbers (``85 or 86``,
   ``84, 85, 86``, working without a stated answer) commit to nothing.

Numbers are integers with an optional sign and thousands commas (``1,234``); a decimal with a
non-zero fraction is not an integer (``85.5`` commits to nothing, ``85.0`` to 85).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["committed_answer", "integers"]

_NUMBER = r"[-−]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-−]?\d+(?:\.\d+)?"
_NUMBER_RE = re.compile(rf"(?<![\w.])({_NUMBER})(?![\w])")
_STATED = re.compile(
    rf"(?:\banswer\b(?:\s+is)?\s*[:=]?|\\boxed\{{)\s*\**\s*\$?\s*({_NUMBER})(?![\w])",
    re.IGNORECASE,
)


def _integer(text: str) -> int | None:
    """The integer a number token writes (``"1,234"`` → 1234, ``"85.0"`` → 85), None for ``"85.5"``."""
    text = text.replace(",", "").replace("−", "-")
    whole, _, fraction = text.partition(".")
    if fraction.strip("0"):
        return None
    return int(whole)


def integers(text: str) -> list[int | None]:
    """Every number written in ``text``, in order (None for one with a non-zero fraction)."""
    return [_integer(m.group(1)) for m in _NUMBER_RE.finditer(text)]


def _stated(response: str) -> list[int | None] | None:
    """The stated answers of rule 1 (None for a list after a statement), [] when there is none."""
    out: list[int | None] = []
    for match in _STATED.finditer(response):
        rest_of_line = response[match.end(1) :].split("\n", 1)[0]
        if _NUMBER_RE.search(rest_of_line.lstrip("}*$ ")):
            return None
        out.append(_integer(match.group(1)))
    return out


def committed_answer(response: str, operands: Iterable[int] = ()) -> int | None:
    """The integer ``response`` commits to under the module's rules, or None when it commits to none.

    Args:
        response: the model's text.
        operands: the question's own numbers; rule 2 does not count them as answers.
    """
    stated = _stated(response)
    if stated is None:
        return None
    if stated:
        return stated[0] if len(set(stated)) == 1 else None
    asked = set(operands)
    candidates = {n for n in integers(response) if n not in asked}
    if len(candidates) != 1:
        return None
    return candidates.pop()
