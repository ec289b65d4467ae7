"""What ``textgym serve-rm`` holds its connections to, below the app: slow clients, connection count, log volume.

Why a protocol of our own: uvicorn times out a keep-alive connection only after a response, and caps
concurrency with a plain-text 503. A client that opens a connection and sends its request head slowly
(or never) held a file descriptor for ever: 1,100 such connections made every request fail with "Too many
open files" and 185 MB of tracebacks in 30 s (issue 37.7). Here each connection must deliver its request
head within ``client_timeout`` (else a JSON 408 and the connection closed), and past ``max_connections``
open ones a new connection gets a JSON 503 at once; the app bounds the body's time itself.
"""

from __future__ import annotations

import json
import logging
import resource
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["RateLimitedLog", "guarded_protocol", "json_answer", "raise_open_files_limit"]


def json_answer(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with ``{"error": message}``, closing the connection (written below the app)."""
    body = json.dumps({"error": message}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")  # fmt: skip
    return head.encode() + body


def guarded_protocol(client_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol held to ``client_timeout`` for each request head and to ``max_connections``."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            if len(self.connections) > max_connections:
                transport.write(json_answer(503, "Service Unavailable", f"the server holds max_connections="
                                            f"{max_connections} connections; retry later"))  # fmt: skip
                transport.close()
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request's head has the same time (the keep-alive timer closes an idle one)

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(client_timeout, self._head_too_slow)

        def _head_too_slow(self) -> None:
            """Close a connection whose request head has not arrived (h11 stays IDLE until the head is whole)."""
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return  # a request is being read or answered: the app's own timeouts hold it
            self.transport.write(json_answer(408, "Request Timeout", f"the request head did not arrive within "
                                             f"client_timeout={client_timeout:g} s"))  # fmt: skip
            self.transport.close()

    return GuardedH11Protocol


class RateLimitedLog(logging.Filter):
    """Lets one record per logger and message template through every ``interval`` seconds.

    The next one let through says how many were dropped meanwhile: a flood of one failure (a model
    that fails every batch, refused connections) costs a line per interval, not a disk.
    """

    def __init__(self, interval: float = 10.0):
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, str], float] = {}
        self._dropped: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        if now - self._last.get(key, -float("inf")) < self.interval:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        self._last[key] = now
        if dropped := self._dropped.pop(key, 0):
            record.msg, record.args = f"{record.getMessage()} ({dropped} more like it in the last interval)", None
        return True


def raise_open_files_limit() -> int:
    """Raise this process's soft open-files limit to its hard limit; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a container that refuses: keep the soft limit
            pass
    return soft
