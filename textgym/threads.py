"""torch's CPU threads: how many, a run setting chosen from the machine's cores.

Why a module of its own: a run's numbers must not depend on how busy the machine is — yet torch's
reductions and matmuls split their work by the thread count, so two thread counts give two
rounding paths, and a count read off the momentary load made a seeded run differ from its own
re-run (and a resume from the uninterrupted run). So the count is chosen from the cores this
process may use (never their load), recorded with the run and reused. What a busy core then costs
in time, and what OpenMP's wait policy changes about it, is measured by
``bench/threads_under_load.py`` (docs/performance.md, "Threads").

Why the default depends on when torch loaded. GNU OpenMP's threads wait for each other at the end
of every parallel region; with libgomp's default wait (spin 300,000 times, then sleep) one core taken
by another job stalls every region until the thread sharing it gets its time slice, and one busy
core of two made the README's snippets 2.6-3.8x slower on every core. A passive wait
(``OMP_WAIT_POLICY=PASSIVE``, read once, when torch loads libgomp: a waiting thread sleeps at once
and is woken ahead of the busy process) kept every core within 1.62x of its idle time beside a busy
core, at 1.14-1.23x of the fastest idle setting on real work; a short spin (``GOMP_SPINCOUNT`` 1,000
or 10,000) did worse on one side or the other (``bench/threads_under_load.py``, docs/performance.md,
"Threads"). So ``import textgym`` before torch sets the passive wait and runs on every core;
imported after torch, where the wait policy is fixed already, it leaves one core free instead (a
busy core then costs little, an idle 2-core machine up to 1.57x).
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "cpu_name",
    "BENCH_THREADS_HELP",
    "WAIT_POLICY",
    "apply_default_threads",
    "default_threads",
    "machine_threads",
    "set_wait_policy",
    "use_threads",
    "wait_policy_set",
]

BENCH_THREADS_HELP = "torch threads (default: textgym's, the count a user's run gets)"
WAIT_POLICY = "PASSIVE"  # OMP_WAIT_POLICY textgym sets before torch loads (bench/threads_under_load.py)
_WAIT_POLICY = {"set": False}  # whether torch loaded after set_wait_policy() chose the wait (or the user did)


def set_wait_policy() -> bool:
    """Before torch loads: how GNU OpenMP's threads wait between parallel regions, ``OMP_WAIT_POLICY=WAIT_POLICY``.

    A wait the user chose (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``) is kept and counts as chosen. Too late once
    torch is imported (libgomp read its environment then): changes nothing. Returns :func:`wait_policy_set`.
    """
    if "torch" in sys.modules:
        return _WAIT_POLICY["set"]
    if "GOMP_SPINCOUNT" not in os.environ:
        os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    _WAIT_POLICY["set"] = True
    return True


def wait_policy_set() -> bool:
    """Whether torch runs with a chosen wait policy (textgym's passive wait or the user's): then every core is the
    default."""
    return _WAIT_POLICY["set"]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere): named beside every timing, and
    the floats of a run depend on it (its kernels sum in their own order)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def machine_threads() -> int:
    """The number of cores this process may run on (its CPU affinity set): the default thread count.

    Not the number of idle cores: that changes with other jobs, and with it a run's numbers.
    """
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_threads() -> int:
    """The thread count a run gets when none is given: ``OMP_NUM_THREADS`` if the user (or torchrun, one per rank)
    set it — torch read it at import — else torch's own count at ``import textgym`` (a thread per core, within
    this process's cores) when torch loaded under a chosen wait policy (:func:`set_wait_policy`), else one
    fewer than the cores, at least one."""
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    if wait_policy_set():
        return min(_WAIT_POLICY.get("torch_threads", machine_threads()), machine_threads())
    return max(1, machine_threads() - 1)


def apply_default_threads() -> int:
    """At ``import textgym``: torch on :func:`default_threads` unless ``OMP_NUM_THREADS`` chose a count.

    Under textgym's wait policy that is torch's own count; imported after torch, a count above one fewer than
    the cores is lowered to it and a lower one the user set is kept. ``torch.set_num_threads`` after the
    import, ``OMP_NUM_THREADS`` or a run's ``threads`` choose another count. Returns the count torch now uses.
    """
    import torch

    _WAIT_POLICY.setdefault("torch_threads", torch.get_num_threads())
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
        raise ValueError(f"threads={threads!r} must be an int >= 1 or None (textgym's default count)")
    n = threads if threads is not None else default_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by cuBLAS when it starts
        torch.use_deterministic_algorithms(True)
    return n
