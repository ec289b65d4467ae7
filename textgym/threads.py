"""torch's CPU threads: how many (a run setting, from the machine's cores) and how they wait.

Why a module of its own: two needs pull on the thread count. A run's numbers must not depend on
how busy the machine is — yet torch's reductions and matmuls split their work by the thread count,
so two thread counts give two rounding paths, and a count read off the momentary load made a
seeded run differ from its own re-run (and a resume from the uninterrupted run). So the count is
chosen from the cores this process may use (never their load), recorded with the run and reused.
A busy core must not then make every parallel op wait: OpenMP's default lets a thread that reaches
a barrier first spin for a long while, holding a core the late thread (sharing its core with
another process) needs. ``OMP_WAIT_POLICY=PASSIVE`` makes waiting threads sleep instead; it is read
once, when torch loads its OpenMP runtime, so it is set here, before ``textgym`` imports torch
(``bench/threads_under_load.py`` measures both policies idle and beside a busy process).
"""

from __future__ import annotations

import os
import sys

__all__ = ["configure_openmp", "default_threads", "machine_threads", "use_threads"]


def configure_openmp() -> bool:
    """Ask OpenMP for a passive wait policy unless the user chose one; returns whether it will apply.

    It applies only when torch has not been imported yet (its OpenMP runtime reads the variable at
    load time); otherwise nothing is set, so child processes inherit the user's environment as it
    was. ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set by the user are left as they are.
    """
    if "torch" in sys.modules:
        return False
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


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
