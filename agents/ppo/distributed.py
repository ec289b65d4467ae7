"""The PPO learner under ``torch.distributed`` (DDP), as ``torchrun --nproc-per-node N`` starts it.

    torchrun --nproc-per-node 2 --no-python textgym train --config demo

Rank 0 collects the rollout (in process, or through Ray rollout workers) and broadcasts it, so every
rank forms the same advantages. Each rank then runs the same epochs and minibatches; inside a
minibatch it takes its contiguous share of the rows, and DDP all-reduces (averages) the gradients.
The losses are token-masked means over the minibatch, so a rank's loss is scaled by
``its valid tokens × world size / the minibatch's valid tokens``: DDP's average of the scaled
gradients is then exactly the single-process gradient of the whole minibatch, and gradient
clipping, the optimizer step and the weights stay identical on every rank. Diagnostics are
token-weighted means over the ranks. Rank 0 alone writes metrics, TensorBoard events and
checkpoints; the others run the same iterations and read the checkpoint on ``--resume`` (one
machine, or ``out`` on a file system every node sees).

CPU processes use the gloo backend, CUDA ones NCCL with one GPU per process (``cuda:LOCAL_RANK``):
the same code path. A process started without torchrun (``WORLD_SIZE`` unset or 1) is a plain
single process and nothing here does anything.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["broadcast_object", "init", "initialized", "is_main", "leave", "mean_over_ranks", "on_main", "rank_share",
           "wrap", "world"]  # fmt: skip

T = TypeVar("T")


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process as torchrun set them (``(0, 1)`` outside torchrun)."""
    if initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    """Whether this process writes the run's files (rank 0, or the only process)."""
    return world()[0] == 0


def init(device: torch.device) -> torch.device:
    """Join the process group torchrun describes (once); return the device this rank computes on.

    A CUDA run puts rank r on ``cuda:LOCAL_RANK`` with NCCL; a CPU run uses gloo. Without
    torchrun (``WORLD_SIZE`` 1 or unset) nothing is started and ``device`` is returned as is.
    """
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def initialized() -> bool:
    """Whether this process is in a process group already."""
    return dist.is_available() and dist.is_initialized()


def leave(finished: bool = True) -> None:
    """Leave the process group :func:`init` joined (nothing outside torchrun).

    ``finished`` (every rank got here without an error): a barrier first, so no collective is still in
    flight. After an error the other ranks may never reach a barrier, so none is waited for.

    Every DDP wrapper must be gone before this (:meth:`.Trainer.close` drops them): a gloo group whose
    last reference a DDP Reducer frees is destroyed with the GIL held, and its destructor waits for a
    thread that needs the GIL to free a finished collective's tensors (the hang at the end of a
    torchrun run). Released by Python, as ``destroy_process_group`` does here, the group lets the GIL
    go first. A collection runs before, so a wrapper kept only by a reference cycle is freed now too.
    """
    if initialized():
        if finished:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def wrap(model: torch.nn.Module | None, device: torch.device) -> torch.nn.Module | None:
    """``model`` under DDP when several processes train (the loss calls it; the bare model is saved)."""
    if model is None or world()[1] == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    # buffers (rotary tables) are the same everywhere: no broadcast before every forward (torch 2.13's
    # name for it; its sync at init copies rank 0's equal buffers once)
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)


def broadcast_object(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (pickled; for the rollout and small state)."""
    if world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_main(fn: Callable[[], T]) -> T:
    """``fn()`` run on rank 0 alone, its result (or its failure) handed to every rank.

    Why: rank 0 decides what happens to the run folder; another rank must neither decide
    differently nor wait forever for a rank that raised.
    """
    if world()[1] == 1:
        return fn()
    result: Any = None
    if is_main():
        try:
            result = ("ok", fn())
        except Exception as err:
            broadcast_object(("error", f"{type(err).__name__}: {err}"))
            raise
    kind, value = broadcast_object(result)
    if kind == "error":
        raise RuntimeError(f"rank 0 failed, so rank {world()[0]} stops too: {value}")
    return value


def rank_share(batch: int) -> tuple[slice, int]:
    """This rank's contiguous rows of a minibatch of ``batch`` rows, and the world size.

    Raises:
        ValueError: fewer rows than ranks (a rank would have nothing to compute on).
    """
    rank, size = world()
    if batch < size:
        raise ValueError(
            f"a minibatch of {batch} episodes cannot be shared by world_size={size} processes: "
            "use num_envs / num_minibatches >= the number of processes (--nproc-per-node)"
        )
    bounds = [round(i * batch / size) for i in range(size + 1)]
    return slice(bounds[rank], bounds[rank + 1]), size


def mean_over_ranks(values: dict[str, float], weight: float) -> dict[str, float]:
    """The ``weight``-weighted sum over ranks of each value (weights summing to 1: a weighted mean).

    With ``weight`` = this rank's share of the minibatch's valid tokens, per-rank token-masked
    means become the token-masked mean over the whole minibatch.
    """
    if world()[1] == 1:
        return values
    keys = sorted(values)
    total = torch.tensor([values[k] * weight for k in keys], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(total)
    return dict(zip(keys, total.tolist()))


def _comm_device() -> torch.device:
    """Where a collective's tensor must live: NCCL reduces CUDA tensors only."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
