"""torch's CPU threads: how many, a run setting chosen from the machine's cores.

Why a module of its own: a run's numbers must not depend on how busy the machine is — yet torch's
reductions and matmuls split their work by the thread count, so two thread counts give two
rounding paths, and a count read off the momentary load made a seeded run differ from its own
re-run (and a resume from the uninterrupted run). So the count is chosen from the cores this
process may use (never their load), recorded with the run and reused. What a busy core then costs
in time, and what OpenMP's wait policy changes about it, is measured by
``bench/threads_under_load.py`` (docs/performance.md, "Threads").

Why one core fewer than the machine has, by default: GNU OpenMP's threads wait for each other at
the end of every parallel region, so one core taken by another job stalls every region until the
thread sharing it gets its time slice. With torch's default (a thread on every core) one busy core
of two made the README's snippets 2.6-3.8x slower; one core left free keeps them within 1.08x of
their idle time, at a price on an idle 2-core machine of up to 1.4x (SB3's update, SmolLM2), less
with more cores. The thread pool's wait policy cannot be changed once torch is loaded, and a
passive one made the idle machine up to 1.5x slower.
"""

from __future__ import annotations

import os

__all__ = ["BENCH_THREADS_HELP", "default_threads", "leave_a_core_free", "machine_threads", "use_threads"]

# the speed benches measure at the hardware limit, not at the library's default
BENCH_THREADS_HELP = "torch threads (default: every core of this process; textgym's own default leaves one free)"


def machine_threads() -> int:
    """The number of cores this process may run on (its CPU affinity set): the default thread count.

    Not the number of idle cores: that changes with other jobs, and with it a run's numbers.
    """
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """The thread count a run gets when none is given: ``OMP_NUM_THREADS`` if the user (or torchrun, one per
    rank) set it — torch read it at import — else one fewer than the cores of this process, at least one."""
    import torch

    return torch.get_num_threads() if "OMP_NUM_THREADS" in os.environ else max(1, machine_threads() - 1)


def leave_a_core_free() -> int:
    """At ``import textgym``: cap torch's threads at :func:`default_threads` unless ``OMP_NUM_THREADS`` chose them.

    A count the user set lower before the import is kept; a higher one (torch's default is one per
    core) is lowered. ``torch.set_num_threads`` after the import, ``OMP_NUM_THREADS`` or a run's
    ``threads`` choose another count. Returns the count torch now uses.
    """
    import torch

    cap = default_threads()
    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > cap:
        torch.set_num_threads(cap)
    return torch.get_num_threads()


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
        raise ValueError(f"threads={threads!r} must be an int >= 1 or None (one fewer than the cores)")
    n = threads if threads is not None else default_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by cuBLAS when it starts
        torch.use_deterministic_algorithms(True)
    return n
