"""The chat prompt sets of the addition task: "What is a + b?" asked of a chat model in words.

Why single digits: RL with a verifiable reward needs a π_ref that is sometimes right (a GRPO group
that is all wrong teaches nothing). SmolLM2-135M-Instruct at temperature 1 under its chat template
answers two-digit sums right 0–2 % of the time and single-digit sums about 20 %
(``python bench/task_accuracy.py``; docs/real-models.md).

``addition-requests`` / ``addition-requests-eval`` ask ``What is {a} + {b}?`` for a, b in 1–9,
split by unordered pair: the eval set's pairs (both orders) are never asked in training. No
operand is 0, so the sum always exceeds both operands and an answer is never an operand
(:mod:`textgym.rewards.answers` does not count operands as answers).
``python -m textgym.assets.addition_requests`` rewrites the two files; a test checks the committed
files are what it writes.
"""

from __future__ import annotations

import random

from textgym.assets import PROMPT_SETS

__all__ = ["EVAL_PAIRS", "TEMPLATE", "problems", "request_lines", "split", "write_sets"]

TEMPLATE = "What is {a} + {b}?"
EVAL_PAIRS = 12  # of the 45 unordered pairs of 1–9
SEED = 0


def problems(digits: tuple[int, int] = (1, 1), count: int | None = None, seed: int = SEED) -> list[tuple[int, int]]:
    """``count`` (None: all) distinct problems (a, b) of these digit counts, no unordered pair twice, seeded."""
    low = [10 ** (d - 1) for d in digits]
    high = [10**d - 1 for d in digits]
    pool = [(a, b) for a in range(low[0], high[0] + 1) for b in range(low[1], high[1] + 1)
            if digits[0] != digits[1] or a <= b]  # fmt: skip
    count = len(pool) if count is None else count
    if count > len(pool):
        raise ValueError(f"count={count} is more than the {len(pool)} distinct problems of {digits} digits")
    rng = random.Random(seed)
    chosen = rng.sample(pool, count)
    return [(a, b) if rng.random() < 0.5 else (b, a) for a, b in chosen]


def _both_orders(pair: tuple[int, int]) -> list[tuple[int, int]]:
    a, b = sorted(pair)
    return [(a, b)] if a == b else [(a, b), (b, a)]


def split() -> dict[str, list[tuple[int, int]]]:
    """Both orders of each single-digit pair, the first ``EVAL_PAIRS`` seeded pairs held out for eval."""
    pairs = problems((1, 1))
    return {"addition-requests": [q for p in pairs[EVAL_PAIRS:] for q in _both_orders(p)],
            "addition-requests-eval": [q for p in pairs[:EVAL_PAIRS] for q in _both_orders(p)]}  # fmt: skip


def request_lines(name: str) -> list[str]:
    """The prompt set ``name``, one request per problem."""
    return [TEMPLATE.format(a=a, b=b) for a, b in split()[name]]


def write_sets() -> None:
    """Write both sets to their files in ``PROMPT_SETS`` (one prompt per line)."""
    for name in split():
        PROMPT_SETS[name].write_text("".join(line + "\n" for line in request_lines(name)), encoding="utf-8")


if __name__ == "__main__":
    write_sets()
