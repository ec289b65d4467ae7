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
3. **No denial, no correction.** A response commits to nothing when a number is denied in its
   clause (``The answer is not 85``, ``it isn't 84``), when a correction word follows the answer
   (``Answer: 84. Actually, 85``; ``wait``, ``wrong``, ``sorry`` …), or when a number other than
   the stated answer and the operands follows a statement (``The answer is 84.\n85.``).

Numbers are integers with an optional sign and thousands commas (``1,234``); a decimal with a
non-zero fraction is not an integer (``85.5`` commits to nothing, ``85.0`` to 85). English number
words are numbers too (``eighty-five``, ``one hundred and twelve``; ``one`` after a determiner, as
in ``this one``, is a pronoun), so ``85 or eighty-six`` is a hedge, not an answer.
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


_UNIT_WORDS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
_UNITS = {w: i for i, w in enumerate(f"{_UNIT_WORDS} seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split(), start=2)}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 1_000_000}
_NUMBER_WORDS = {**_UNITS, **_TENS, **_SCALES}
_DETERMINERS = {"the", "this", "that", "each", "every", "any", "no", "which", "another", "a"}
_WORD_RE = re.compile(r"[A-Za-z]+(?:[’']t)?")
_DENIAL = re.compile(r"\b(?:not|no|never|neither|nor)\b|n[’']t\b", re.IGNORECASE)
_CORRECTION = re.compile(r"\b(?:actually|wait|correction|oops|sorry|mistake|wrong|incorrect|instead)\b", re.IGNORECASE)
_CLAUSE_END = re.compile(r"[.!?;\n]")


def _integer(text: str) -> int | None:
    """The integer a number token writes (``"1,234"`` → 1234, ``"85.0"`` → 85), None for ``"85.5"``."""
    text = text.replace(",", "").replace("−", "-")
    whole, _, fraction = text.partition(".")
    if fraction.strip("0"):
        return None
    return int(whole)


def _joins(prev: str, word: str, gap: str) -> bool:
    """Whether number word ``word`` continues the number that ``prev`` ends (``eighty-five``, ``hundred and two``)."""
    if not (re.fullmatch(r"[\s-]+", gap) or (prev in _SCALES and re.fullmatch(r"\s+and\s+", gap))):
        return False
    return word in _SCALES or (prev in _TENS and 1 <= _UNITS.get(word, 0) <= 9) or prev in _SCALES


def _word_value(words: list[str]) -> int:
    """The integer a run of number words writes (``["one", "hundred", "twelve"]`` → 112)."""
    total = current = 0
    for word in words:
        if word == "hundred":
            current = max(current, 1) * 100
        elif word in _SCALES:
            total, current = total + max(current, 1) * _SCALES[word], 0
        else:
            current += _NUMBER_WORDS[word]
    return total + current


def _word_numbers(text: str) -> list[tuple[int, int, int | None]]:
    """(start, end, value) of every number written in words, a run of words such as ``eighty-five`` being one."""
    runs: list[tuple[int, int, list[str]]] = []
    prev_word, prev_end = "", -1
    for match in _WORD_RE.finditer(text):
        word = match.group(0).lower()
        if word == "and" and runs and runs[-1][1] == prev_end and prev_word in _SCALES:
            continue  # "hundred and twelve": _joins reads the gap
        pronoun = word == "one" and prev_word in _DETERMINERS
        if word in _NUMBER_WORDS and not pronoun:
            last = runs[-1] if runs else None
            if last is not None and last[1] == prev_end and _joins(last[2][-1], word, text[last[1] : match.start()]):
                runs[-1] = (last[0], match.end(), [*last[2], word])
            else:
                runs.append((match.start(), match.end(), [word]))
        prev_word, prev_end = word, match.end()
    return [(start, end, _word_value(words)) for start, end, words in runs]


def _numbers(text: str) -> list[tuple[int, int, int | None]]:
    """(start, end, value) of every number in ``text``, digits and words, in order (None: a non-zero fraction)."""
    digits = [(m.start(1), m.end(1), _integer(m.group(1))) for m in _NUMBER_RE.finditer(text)]
    return sorted(digits + _word_numbers(text))


def integers(text: str) -> list[int | None]:
    """Every number written in ``text``, digits or words, in order (None for one with a non-zero fraction)."""
    return [value for _, _, value in _numbers(text)]


def _stated(response: str) -> tuple[list[int | None], int] | None:
    """The stated answers of rule 1 and where the first one ends (None for a list after a statement)."""
    out: list[int | None] = []
    first_end = -1
    for match in _STATED.finditer(response):
        rest_of_line = response[match.end(1) :].split("\n", 1)[0]
        if _numbers(rest_of_line.lstrip("}*$ ")):
            return None
        out.append(_integer(match.group(1)))
        first_end = match.end(1) if first_end < 0 else first_end
    return out, first_end


def _denied(response: str, numbers: list[tuple[int, int, int | None]]) -> bool:
    """Whether a denial (``not``, ``no``, ``n't`` …) stands in some number's clause, before the number."""
    clause_start = 0
    for start, end, _ in numbers:
        boundaries = [m.end() for m in _CLAUSE_END.finditer(response, clause_start, start)]
        clause_start = boundaries[-1] if boundaries else clause_start
        if _DENIAL.search(response[clause_start:start]):
            return True
        clause_start = end  # the next number's clause starts after this one ("84, not 85")
    return False


def committed_answer(response: str, operands: Iterable[int] = ()) -> int | None:
    """The integer ``response`` commits to under the module's rules, or None when it commits to none.

    Args:
        response: the model's text.
        operands: the question's own numbers; rule 2 does not count them as answers.
    """
    asked, numbers = set(operands), _numbers(response)
    stated = _stated(response)
    if stated is None or _denied(response, numbers):
        return None
    answers, after = stated
    if answers:  # rule 1, then rule 3: after the statement only the answer and the operands may be written
        later = {value for start, _, value in numbers if start >= after}
        if len(set(answers)) != 1 or not later <= asked | {answers[0]} or _CORRECTION.search(response, after):
            return None
        return answers[0]
    candidates = [(end, value) for _, end, value in numbers if value not in asked]
    if len({value for _, value in candidates}) != 1 or _CORRECTION.search(response, candidates[0][0]):
        return None
    return candidates[0][1]
