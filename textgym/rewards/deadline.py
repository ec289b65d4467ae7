"""A total deadline for an ``httpx`` request: every socket wait of the request ends by one instant.

Why: httpx's timeouts bound each socket operation, not the request. A server that drips its answer one
byte every 2 s passes a 5 s read timeout for as long as it likes (46 s were measured, issue 37.2). Here
each connect, read and write is given at most the time left until the request's deadline, so the request
as a whole ends by it (give or take one scheduler tick), raising httpx's own timeout exception.

The deadline is a context variable set around the request (:func:`deadline`), read by the socket wrappers
of a connection pool built on :class:`DeadlineBackend` (:func:`deadline_transport`). Used by
:class:`textgym.rewards.http.HTTPRewardModel`; importing this module needs ``httpx`` (the ``serve`` extra).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from typing import Any

import httpcore
import httpx

__all__ = ["DeadlineBackend", "deadline", "deadline_transport"]

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("textgym_http_deadline", default=None)
_LAST_TICK = 1e-3  # a socket timeout of 0 would make it non-blocking: past the deadline each wait gets 1 ms


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Every socket wait inside the block ends within ``seconds`` of its start (None: no deadline)."""
    token = _DEADLINE.set(None if seconds is None else time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _clamp(timeout: float | None) -> float | None:
    """``timeout`` cut to the time left before the current deadline."""
    end = _DEADLINE.get()
    if end is None:
        return timeout
    left = max(end - time.monotonic(), _LAST_TICK)
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read and write waits no longer than the deadline allows."""

    def __init__(self, stream: httpcore.NetworkStream):
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _clamp(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _clamp(timeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None, timeout: float | None = None):
        return _DeadlineStream(self._stream.start_tls(ssl_context, server_hostname, _clamp(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's blocking socket backend, its connects and streams held to the current deadline."""

    def __init__(self):
        self._backend = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options=None) -> httpcore.NetworkStream:  # fmt: skip
        return _DeadlineStream(self._backend.connect_tcp(host, port, _clamp(timeout), local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options=None):
        return _DeadlineStream(self._backend.connect_unix_socket(path, _clamp(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


def deadline_transport() -> httpx.HTTPTransport:
    """An ``httpx.HTTPTransport`` (no proxy, default TLS and limits) whose connections keep :func:`deadline`.

    httpx takes no network backend, so its connection pool is rebuilt on one: the pool is the
    transport's ``_pool``, the one attribute httpx's transport sends every request through
    (tests/test_rm_server.py holds a dripping server to the deadline, so a change there shows).
    """
    transport = httpx.HTTPTransport(trust_env=False)
    if not isinstance(getattr(transport, "_pool", None), httpcore.ConnectionPool):
        raise RuntimeError(f"httpx {httpx.__version__}: HTTPTransport has no httpcore pool to hold to a deadline")
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)  # httpx's defaults
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=5.0,
        network_backend=DeadlineBackend(),
    )
    return transport
