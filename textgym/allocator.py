"""The C allocator's large-block threshold, fixed: freed tensors go back to the OS instead of filling holes.

Why: glibc's ``malloc`` serves a block above its mmap threshold with ``mmap`` (returned to the OS on
``free``) and smaller ones from its heaps, where a freed block stays mapped until the heap's top is free.
The threshold is dynamic: each time an mmapped block is freed it rises to that block's size, up to
32 MiB. A training iteration frees and allocates tensors of a few MiB by the thousand (activations, a
KV cache that grows by concatenation each decode step), so after the first of them every such tensor
lands in a heap, and the heaps fragment: the process's RSS climbs far above what is alive. Fixing the
threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic rule off) keeps every block above
it in its own mapping. Measured in docs/performance.md, "Memory (issue 41)": one SmolLM2 sentiment PPO
iteration's peak RSS 7.35 → 6.84 GiB at this 1 MiB threshold (6.45 GiB at 128 KiB; GuessTheNumber GRPO
8.99 → 7.51 GiB at 128 KiB). PyTorch's CPU tuning guide names the same cause and swaps in jemalloc or
tcmalloc; this needs no other library.

A user who sets ``MALLOC_MMAP_THRESHOLD_`` (glibc's own variable) keeps theirs, ``TEXTGYM_MMAP_THRESHOLD``
sets textgym's (bytes; ``0`` leaves glibc's dynamic rule); other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["MMAP_THRESHOLD", "fix_mmap_threshold"]

MMAP_THRESHOLD = 1 << 20  # 1 MiB: a tensor of 256k floats or more gets its own mapping
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def fix_mmap_threshold(threshold: int | None = None) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (default: ``TEXTGYM_MMAP_THRESHOLD``, else
    :data:`MMAP_THRESHOLD`); returns whether it was set (glibc, not set by the user, not 0)."""
    if threshold is None:
        value = os.environ.get("TEXTGYM_MMAP_THRESHOLD", str(MMAP_THRESHOLD))
        if not value.strip().isdigit():
            raise ValueError(f"TEXTGYM_MMAP_THRESHOLD={value!r} is not a byte count: give an integer >= 0 "
                             "(0 leaves glibc's dynamic threshold)")  # fmt: skip
        threshold = int(value)
    if threshold <= 0 or not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)))
    except (OSError, AttributeError):  # not glibc: no mallopt
        return False
