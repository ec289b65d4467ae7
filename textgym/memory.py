"""How much memory this process may use, and a refusal that names what would not fit.

Shared by the env (its slots' arrays and caches, :class:`textgym.envs.engine.Engine`) and the trainer's
batch guard (``textgym.agents.ppo.guards``): both refuse before they allocate, naming the setting to change.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["available_memory", "exceeded", "kv_cache_bytes", "kv_width", "total_memory"]


def available_memory() -> int | None:
    """Bytes of memory a new allocation can still get (``MemAvailable``), or None where it cannot be read."""
    return _meminfo("MemAvailable")


def total_memory() -> int | None:
    """Bytes of memory this process may ever use: ``MemTotal``, or a smaller cgroup limit (a container's)."""
    sizes = [_meminfo("MemTotal")]
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            sizes.append(int(Path(path).read_text().strip()))
        except (OSError, ValueError):  # no such cgroup file, or "max": no limit
            continue
    known = [size for size in sizes if size is not None]
    return min(known) if known else None


def kv_width(config) -> int:
    """Keys (or values) per token and layer of a transformers ``config``: KV heads × head size (GQA-aware)."""
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (getattr(config, "num_key_value_heads", None) or heads) * head_dim


def kv_cache_bytes(layers: int, width: int, columns: int, itemsize: int) -> int:
    """Bytes of one slot's KV cache: K and V of every layer over ``columns``, ``itemsize`` bytes an element."""
    return 2 * layers * width * columns * itemsize


def exceeded(need: float) -> tuple[str, int] | None:
    """``(the memory need bytes exceed, in words; its size)``, or None when they fit.

    Held first against the machine's memory (the answer depends on the machine, not the moment), then
    against what is available now.
    """
    total, have = total_memory(), available_memory()
    if total is not None and need > total:
        return f"the {total / 2**30:.2f} GiB this machine has", total
    if have is not None and need > have:
        return f"the {have / 2**30:.2f} GiB available now", have
    return None


def _meminfo(key: str) -> int | None:
    """``key`` of ``/proc/meminfo`` in bytes, or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
