"""Errors a user's reward model or partner can cause, in a module without torch: the CLI catches them."""

from __future__ import annotations

__all__ = ["RewardModelError"]


class RewardModelError(RuntimeError):
    """A reward model failed or returned something that is not one finite float per episode."""
