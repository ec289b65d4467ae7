"""The chat prompt sets of the sentiment task: each review opening as a request to a chat model.

``review-requests`` / ``review-requests-eval`` ask, for each opening of the train / eval split,
``Write a short movie review that begins with "<opening>".``; ``review-requests-reworded`` asks for
the same eval openings in other words (``Tell a friend what you thought of a movie you just saw,
starting with "<opening>".``), so a policy trained on the first wording can be judged on requests
worded unlike any it trained on. ``python -m textgym.assets.review_requests`` rewrites the three
files from the opening files; a test checks the committed files are what it writes.
"""

from __future__ import annotations

from pathlib import Path

from textgym.assets import DEFAULT_PROMPTS, EVAL_PROMPTS, PROMPT_SETS

__all__ = ["TEMPLATES", "request_lines", "write_sets"]

TEMPLATES = {
    "review-requests": (DEFAULT_PROMPTS, 'Write a short movie review that begins with "{}".'),
    "review-requests-eval": (EVAL_PROMPTS, 'Write a short movie review that begins with "{}".'),
    "review-requests-reworded": (EVAL_PROMPTS, 'Tell a friend what you thought of a movie you just saw, starting '
                                               'with "{}".'),
}  # fmt: skip


def request_lines(name: str) -> list[str]:
    """The prompt set ``name``: its template filled with each opening of its split, in order."""
    openings, template = TEMPLATES[name]
    return [template.format(opening) for opening in Path(openings).read_text(encoding="utf-8").splitlines()]


def write_sets() -> None:
    """Write every set of ``TEMPLATES`` to its file in ``PROMPT_SETS`` (one prompt per line)."""
    for name in TEMPLATES:
        PROMPT_SETS[name].write_text("".join(line + "\n" for line in request_lines(name)), encoding="utf-8")


if __name__ == "__main__":
    write_sets()
