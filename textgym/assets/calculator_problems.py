"""The prompt sets of the calculator task: ``a * b + c`` asked of a chat model that has the calculator tool.

Why these problems: a 3-digit times 2-digit product plus a 3-digit number is out of reach of
SmolLM2-135M-Instruct's mental arithmetic (π_ref answers under 10 % of them right with the tool at hand;
docs/multi-turn.md), while one call ``<calc>a * b + c</calc>`` solves it: what is learnt is *using* the
tool, calling it and copying its result as the answer.

Why a worked example in the prompt: asked plainly, π_ref never calls the tool (0 calls in 80 plainly
asked problems, bench/drift.py), and RL cannot reinforce what is never sampled. One worked call
(``12 * 34 + 5``, not of the sets' digit counts) makes π_ref call the tool in about a third of its
first turns at temperature 0.7, and answer right in a few percent.

``calculator-problems`` (2,000 problems) and ``calculator-problems-eval`` (256, none of them in
training) are ``.jsonl`` files, one ``{"prompt": ...}`` per line (a prompt spans lines).
``python -m textgym.assets.calculator_problems`` rewrites them; a test checks the committed files
are what it writes.
"""

from __future__ import annotations

import json
import random

from textgym.asset_paths import PROMPT_SETS

__all__ = ["SIZES", "TEMPLATE", "problems", "prompt_lines", "write_sets"]

TEMPLATE = (
    "You have a calculator. To use it, write <calc>EXPRESSION</calc> and it answers <result>VALUE</result>.\n"
    "Example:\nQuestion: What is 12 * 34 + 5?\nYou: <calc>12 * 34 + 5</calc>\nCalculator: <result>413</result>\n"
    "You: 413\n\nQuestion: What is {a} * {b} + {c}?"
)
SIZES = {"calculator-problems": 2000, "calculator-problems-eval": 256}
SEED = 0


def problems(seed: int = SEED) -> dict[str, list[tuple[int, int, int]]]:
    """Each set's distinct problems (a 3-digit, b 2-digit, c 3-digit), drawn without replacement, seeded:
    the eval set's problems are never asked in training."""
    rng = random.Random(seed)
    drawn: dict[tuple[int, int, int], None] = {}  # insertion-ordered: the draw order is the sets' order
    while len(drawn) < sum(SIZES.values()):
        drawn.setdefault((rng.randint(100, 999), rng.randint(10, 99), rng.randint(100, 999)))
    pool, out = list(drawn), {}
    for name, size in SIZES.items():
        out[name], pool = pool[:size], pool[size:]
    return out


def prompt_lines(name: str) -> list[str]:
    """The prompt set ``name``, one prompt per problem."""
    return [TEMPLATE.format(a=a, b=b, c=c) for a, b, c in problems()[name]]


def write_sets() -> None:
    """Write both sets to their ``.jsonl`` files in ``PROMPT_SETS``."""
    for name in SIZES:
        rows = (json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in prompt_lines(name))
        PROMPT_SETS[name].write_text("".join(rows), encoding="utf-8")


if __name__ == "__main__":
    write_sets()
