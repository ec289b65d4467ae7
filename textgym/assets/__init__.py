"""The embedded models and prompt files: where each one is, and the names prompt sets go by.

The folders are Hugging Face model folders built by the scripts beside this file
(``python -m textgym.assets.build``, ``build_arithmetic``, ``build_arith_proxy``); the prompt
files hold one prompt per line. Only paths here (:mod:`textgym.asset_paths`, re-exported): importing
this package imports no model code.
"""

from textgym.asset_paths import *  # noqa: F403
from textgym.asset_paths import __all__  # noqa: F401
