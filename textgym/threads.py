"""torch's CPU threads: how many, a run setting chosen from the machine's cores.

Why a module of its own: a run's numbers must not depend on how busy the machine is — yet torch's
reductions and matmuls split their work by the thread count, so two thread counts give two
rounding paths, and a count read off the momentary load made a seeded run differ from its own
re-run (and a resume from the uninterrupted run). So the count is chosen from the cores this
process may use (never their load), recorded with the run and reused. What a busy core then costs
in time, and what OpenMP's wait policy changes about it, is measured by
``bench/threads_under_load.py`` (docs/performance.md, "Threads").
"""

from __future__ import annotations

import os

__all__ = ["default_threads", "machine_threads", "use_threads"]


def machine_threads() -> int:
    """The number of cores this process may run on (its CPU affinity set): the default thread count.

    Not the number of idle cores: that changes with other jobs, and with it a run's numbers.
    """
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """The thread count a run gets when none is given: ``OMP_NUM_THREADS`` if the user (or torchrun, one per
    rank) set it — torch read it at import — else one per core of this process (:func:`machine_threads`)."""
    import torch

    return torch.get_num_threads() if "OMP_NUM_THREADS" in os.environ else machine_threads()


def use_threads(threads: int | None, deterministic: bool = False) -> int:
    """Set torch's intra-op thread count (``None``: :func:`default_threads`) and optionally its deterministic mode.

    Args:
        threads: an int >= 1, or None for the default.
        deterministic: also ``torch.use_deterministic_algorithms(True)`` (ops without a deterministic
            implementation then raise instead of running nondeterministically); on CUDA, cuBLAS needs
            ``CUBLAS_WORKSPACE_CONFIG`` for that, set to ``:4096:8`` unless the user set it.

    Returns:
        The thread count torch now uses.

    Raises:
        ValueError: ``threads`` is not None or an int >= 1.
    """
    import torch

    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads={threads!r} must be an int >= 1 or None (one per core of this process)")
    n = threads if threads is not None else default_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by cuBLAS when it starts
        torch.use_deterministic_algorithms(True)
    return n
