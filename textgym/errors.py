"""Errors a user's reward model or partner can cause, and how an error shows a value, in a module without torch:
the CLI catches them."""

from __future__ import annotations

__all__ = ["RewardModelError", "short_repr"]


class RewardModelError(RuntimeError):
    """A reward model failed or returned something that is not one finite float per episode."""


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters: an error message never echoes a 10k-character prompt."""
    text = repr(value)
    if len(text) <= limit:
        return text
    if isinstance(value, str):
        return f"{value[:limit]!r}... ({len(value)} characters)"
    return f"{text[:limit]}... ({type(value).__name__}, {len(text)} characters as repr)"
