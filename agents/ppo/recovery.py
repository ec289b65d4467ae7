"""A checkpoint when a run stops on an error: its last completed iteration, never a half-updated one.

Checkpoints are written every ``checkpoint_every`` iterations, so a run that stops on an error (a reward
server gone, a non-finite reward) would lose every iteration since the last one. What an iteration
changes before its update is small — the RNG streams it draws from and the β it samples at — so the
loop captures that at each iteration's start (:class:`Boundary`); on an error the trainer is put back
there and saved, which is the very checkpoint a save at that iteration would have written: the resumed
run equals the uninterrupted one. Once the update has begun (the optimizer has stepped) the weights are
no longer that iteration's and nothing is saved. Ray rollout workers keep RNG streams of their own,
which are not rewound: a run on workers keeps its last periodic checkpoint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import checkpoint
from .checkpoint import read_state

__all__ = ["Boundary", "save_on_error"]


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken over all parameters (Adam's per-parameter ``step``): it moves only in an update."""
    return sum(int(state.get("step", 0)) for state in optimizer.state.values())


@dataclass
class Boundary:
    """The trainer's state at an iteration's start that the rollout changes (RNG streams, β), and how far it was."""

    iteration: int
    steps: int
    rng_json: dict[str, Any]
    rng_tensors: dict[str, Any]
    sampler_rng: torch.Tensor
    env_rng: Any
    last_beta: float

    @classmethod
    def capture(cls, trainer) -> Boundary:
        rng_json, rng_tensors = checkpoint.rng_states()
        sampler_rng, env_rng = trainer.sampler.generator.get_state(), trainer.envs.unwrapped.rng_state()
        steps = optimizer_steps(trainer.optimizer)
        return cls(trainer.iteration_done, steps, rng_json, rng_tensors, sampler_rng, env_rng, trainer.last_beta)

    def restore(self, trainer) -> bool:
        """Put ``trainer`` back at this boundary; False when it cannot be (its update had begun)."""
        if trainer.iteration_done != self.iteration or optimizer_steps(trainer.optimizer) != self.steps:
            return False
        checkpoint.set_rng_states(self.rng_json, self.rng_tensors)
        trainer.sampler.generator.set_state(self.sampler_rng)
        trainer.envs.unwrapped.set_rng_state(self.env_rng)
        trainer.last_beta = self.last_beta
        return True


def save_on_error(out: Path, trainer, boundary: Boundary | None, err: Exception) -> None:
    """Save the checkpoint of the last completed iteration after ``err`` stopped the run, and say on stderr what
    ``out`` holds. A failure of this save is reported, never raised over ``err``."""
    ckpt = out / "checkpoint"
    done = trainer.iteration_done  # iterations completed: an error after an iteration's update leaves it done
    if done > 0 and _saved_iteration(ckpt) == done:
        print(f"textgym: stopped on {type(err).__name__}; the checkpoint in {ckpt} holds iteration {done}, the last "
              "completed; --resume continues from it", file=sys.stderr)  # fmt: skip
        return
    why = _why_not_saved(trainer, boundary)
    if why is None:
        try:
            trainer.save(out)
        except Exception as save_err:  # noqa: BLE001 - the run's own error is the one raised
            why = f"the save failed too ({type(save_err).__name__}: {save_err})"
    if why is None:
        note = f"the checkpoint of iteration {done} is saved in {ckpt}; --resume continues from it"
    elif (saved := _saved_iteration(ckpt)) is not None:
        note = f"iteration {done} is not saved ({why}); the checkpoint in {ckpt} holds iteration {saved}, --resume "
        note += "continues from it"
    else:
        note = f"no checkpoint is saved ({why}); start the run again (--overwrite)"
    print(f"textgym: stopped on {type(err).__name__}; {note}", file=sys.stderr)


def _why_not_saved(trainer, boundary: Boundary | None) -> str | None:
    """Why the last completed iteration cannot be saved now (None: save it)."""
    done = trainer.iteration_done
    if done == 0:
        return "no iteration had completed"
    if trainer.cfg.num_workers:
        return "Ray workers' RNG streams cannot be rewound"
    if boundary is not None and done == boundary.iteration and not boundary.restore(trainer):
        return "the error came during its update, which had changed the weights"
    return None  # between iterations (the error came after one), or rewound to the start of the failed one


def _saved_iteration(ckpt: Path) -> int | None:
    try:
        return read_state(ckpt)["iteration"]
    except (OSError, ValueError):
        return None
