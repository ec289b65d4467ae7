"""Calling user code with a time limit: a reward model's ``score`` or a partner's ``reply``.

Why a thread and not a signal: ``signal.alarm`` only works on the main thread of the main
interpreter, while env steps may run on worker threads; a daemon thread works anywhere. The price:
a thread cannot be killed, so a hung call is abandoned (it finishes, or not, in the background) and
the caller undoes its step. Why a module of its own: the reward models and the partners both need it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["CallAbandoned", "call_within"]

T = TypeVar("T")


class CallAbandoned(TimeoutError):
    """The call did not return within its timeout and was abandoned.

    A class of its own, so that a caller tells this hang apart from a ``TimeoutError`` that the user's
    code raised itself (an HTTP client's, say), which is a failure to report as such.
    """


def call_within(fn: Callable[[], T], timeout: float, thread_name: str) -> T:
    """``fn()`` on a daemon thread, waited for at most ``timeout`` seconds.

    Args:
        fn: the call, without arguments (bind them with a lambda or ``functools.partial``).
        timeout: seconds to wait.
        thread_name: names the thread in a stack dump (``textgym-partner``), so a hung call is findable.

    Returns:
        What ``fn`` returned; whatever it raised is raised again here, in the caller's thread.

    Raises:
        CallAbandoned: ``fn`` was still running after ``timeout`` seconds.
    """
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as err:  # handed to the caller's thread
            box["err"] = err

    thread = threading.Thread(target=run, name=thread_name, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CallAbandoned(f"{thread_name} did not return within {timeout} s")
    if "err" in box:
        raise box["err"]
    return box["out"]
