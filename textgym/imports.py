"""Importing the module of a ``"package.module:attr"`` argument (``reward_model=``, ``partner=``).

Why a module of its own: the reward-model registry and the partners resolve such strings alike, and a
helper two modules need is neither's private function.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

__all__ = ["import_module_named", "import_optional"]


def import_optional(module: str, needs: str, package: str, install: str):
    """``module`` of an optional dependency, imported on first use; its absence one ImportError saying what needs
    it and how to install it ("GEM environments need the gem-llm package (...); install it with: ...").

    Why one helper: every adapter and task of another package (TextArena, GEM, skyrl-gym, OpenEnv,
    reasoning-gym) imports it only when used, and a user missing it should read the same sentence each time.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{needs} need the {package} package ({err}); install it with: {install}") from err


def import_module_named(module_name: str, argument: str, text: str):
    """Import ``module_name``, also from the working directory.

    Why: a console script (``textgym``) puts its own folder on ``sys.path``, not the working directory
    as ``python -m`` and ``python -c`` do, so ``--reward-model myrm:score`` beside ``myrm.py`` would fail.
    """
    try:
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if not _add_working_directory(module_name, err):
                raise
            return importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{argument}={text!r}: module {module_name!r} cannot be imported ({err})") from err


def _add_working_directory(module_name: str, err: ModuleNotFoundError) -> bool:
    """Put the working directory first on ``sys.path`` if the missing module is there (kept, as ``python -m`` does)."""
    top, cwd = module_name.partition(".")[0], os.getcwd()
    here = (Path(cwd) / f"{top}.py").is_file() or (Path(cwd) / top).is_dir()
    if err.name != top or not here or cwd in sys.path:
        return False
    sys.path.insert(0, cwd)
    return True
