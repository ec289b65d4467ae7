"""KL coefficient controllers (Ziegler et al., 2019, "Fine-Tuning Language Models from Human Preferences")."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["AdaptiveKLController", "FixedKLController", "make_kl_controller"]


@dataclass
class FixedKLController:
    """β stays at its initial value."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


@dataclass
class AdaptiveKLController:
    """Proportional control of β towards a target KL.

    e = clip(KL / target − 1, −0.2, 0.2);  β ← β · (1 + e · n_steps / horizon),
    with ``n_steps`` the episodes of the batch and ``horizon`` in episodes.

    KL is the rollout's mean per-sequence k1 estimate Σ_t log π(a_t|s_t) − log π_ref(a_t|s_t) under the
    distribution the tokens were sampled from. With top-k/top-p sampling that is the truncated π, so
    the target includes the truncation's own KL(π_truncated ‖ π_ref), > 0 already at initialisation
    (measured in docs/training.md): a target below it makes β grow whatever the policy does.
    """

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target, self.horizon = state["value"], state["target"], state["horizon"]


def make_kl_controller(kl_coef: float, target_kl: float | None, horizon: int):
    """Adaptive when ``target_kl`` is set, fixed otherwise."""
    if target_kl is None:
        return FixedKLController(kl_coef)
    return AdaptiveKLController(kl_coef, target_kl, horizon)
