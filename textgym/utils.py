"""Small file-system helpers."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

__all__ = ["save_folder_atomically"]


def save_folder_atomically(out: str | Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp_dir)`` then move ``tmp_dir`` onto ``out``: no half-written folder is left."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a plain mkdir (not mkdtemp, whose 0700 would make the saved folder private): the umask applies
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex}")
    tmp.mkdir()
    try:
        write(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
