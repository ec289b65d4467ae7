"""textgym/allocator.py: freed tensors go back to the OS instead of staying in malloc's heaps."""

import subprocess
import sys

import pytest

# In a fresh process (the threshold is process-wide): free one 8 MiB tensor (glibc's dynamic rule then raises its
# mmap threshold to 8 MiB), then make 200 tensors of 1.5 MiB, keep every tenth and free the rest: in a heap the
# freed ones between the kept ones stay resident; each in its own mapping, they are unmapped.
PROBE = """
import os, torch, textgym
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
big = torch.ones(2 * 2**20)  # 8 MiB
del big
before = rss()
blocks = [torch.ones(384 * 1024) for _ in range(200)]  # 1.5 MiB each, 300 MiB in all
kept = blocks[::10]
del blocks
print((rss() - before) / 2**20)
"""


def _resident_growth(threshold: str) -> float:
    env = {"TEXTGYM_MMAP_THRESHOLD": threshold, "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (mallopt) on Linux")
def test_freed_tensors_are_returned_with_the_fixed_threshold_and_kept_without_it():
    fixed, dynamic = _resident_growth(str(1 << 20)), _resident_growth("0")
    assert fixed < 60, fixed  # the 20 kept blocks: 30 MiB
    assert dynamic > 200, dynamic  # the 180 freed ones stayed in the heap (what issue 41's runs paid)


def test_a_threshold_that_is_no_byte_count_is_refused_naming_the_variable(monkeypatch):
    from textgym.allocator import fix_mmap_threshold

    monkeypatch.setenv("TEXTGYM_MMAP_THRESHOLD", "1MiB")
    with pytest.raises(ValueError, match=r"TEXTGYM_MMAP_THRESHOLD='1MiB' is not a byte count"):
        fix_mmap_threshold()
