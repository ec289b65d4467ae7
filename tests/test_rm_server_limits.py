"""``textgym serve-rm`` under abuse (issue 37.7): length caps, back-pressure, timeouts, clients that leave, JSON errors.

Loopback only: uvicorn serves the app on 127.0.0.1 at a free port in a thread of this process, and every
wait is bounded (a gate the model blocks on is released by each test, at the latest after 10 s).
"""

import contextlib
import json
import logging
import re
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from textgym.models import DEFAULT_LM, DEFAULT_RM, load_tokenizer
from textgym.rewards import HFRewardModel, make_reward_model
from textgym.rewards.server import create_app


class Gate:
    """A reward model that records each batch and blocks on ``release`` (10 s at most) before scoring it."""

    name = "gate"
    shares_tokenizer = False

    def __init__(self):
        self.release = threading.Event()
        self.batches: list[list[str]] = []

    def score(self, episodes):
        self.batches.append(list(episodes.responses))
        self.release.wait(10)
        return [1.0] * len(episodes)


@contextlib.contextmanager
def running(app, http="auto"):
    """``app`` served by uvicorn on 127.0.0.1 (a thread of this process); yields its base URL."""
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, http=http, log_level="critical", timeout_keep_alive=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def post_in_thread(url: str, body: dict, out: list, timeout: float = 15.0) -> threading.Thread:
    """POST ``body`` on a thread; appends the response (or the exception) to ``out``."""

    def run():
        try:
            out.append(httpx.post(url, json=body, timeout=timeout))
        except httpx.HTTPError as err:
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def wait_until(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def one(response: str) -> dict:
    return {"prompts": ["p"], "responses": [response]}


# ---------------------------------------------------------------- what one request may ask


def test_an_episode_longer_than_the_reward_models_context_is_refused_413():
    """A 96 KB query was scored (14 s, 988 MiB on the embedded RM, whose context is 128 positions)."""
    app = create_app(HFRewardModel(DEFAULT_RM), load_tokenizer(DEFAULT_LM))
    with TestClient(app) as client:
        fine = client.post("/score", json=one(" a fine film"))
        long = client.post("/score", json=one(" good" * 200))
        huge = client.post("/score", json=one("x" * 96_000))
    assert fine.status_code == 200
    assert long.status_code == 413 and "episode 0 is 202 tokens" in long.json()["error"]
    assert "max_tokens=128 (the reward model's context)" in long.json()["error"]
    assert huge.status_code == 413 and "96001 characters" in huge.json()["error"]


@pytest.mark.parametrize(
    ("content", "status", "pattern"),
    [
        (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
        (b'{"prompts": ["p"], "responses": ["\\ud800 lone"]}', 422, "responses[0] is not valid Unicode"),
        (b'{"query": ["\\udfff"]}', 422, "query[0] is not valid Unicode"),
    ],
)
def test_deep_nesting_and_lone_surrogates_are_json_errors(content, status, pattern):
    """Both gave a plain-text 500 (RecursionError; UnicodeEncodeError in the tokenizer)."""
    app = create_app(make_reward_model(lambda prompts, responses: [1.0] * len(responses)), load_tokenizer(DEFAULT_LM))
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/score" if b"prompts" in content else "/get_reward", content=content)
    assert answer.status_code == status and pattern in answer.json()["error"]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"max_pending": 0}, "max_pending=0 must be an int >= 1"),
        ({"max_tokens": "128"}, "max_tokens='128' must be an int >= 1, \"auto\" or None"),
        ({"client_timeout": 0}, "client_timeout=0 must be a finite number of seconds > 0"),
        ({"request_timeout": float("inf")}, "request_timeout=inf must be a finite number of seconds > 0"),
    ],
)
def test_a_limit_out_of_range_is_refused_naming_it(kwargs, pattern):
    with pytest.raises(ValueError, match=re.escape(pattern)):
        create_app(Gate(), **kwargs)


# ---------------------------------------------------------------- back-pressure and requests nobody waits for


def test_requests_past_max_pending_get_429_with_retry_after():
    """200 clients got a p99 of 12.8 s and no sign to back off; past max_pending the server says so at once."""
    model = Gate()
    answers: list = []
    with running(create_app(model, max_pending=2)) as url:
        threads = [post_in_thread(f"{url}/score", one(f"r{i}"), answers) for i in range(2)]
        wait_until(lambda: model.batches)  # the first is being scored, the second waits
        time.sleep(0.2)
        start = time.monotonic()
        third = httpx.post(f"{url}/score", json=one("r2"), timeout=10)
        took = time.monotonic() - start
        model.release.set()
        for t in threads:
            t.join(15)
    assert third.status_code == 429 and "max_pending=2" in third.json()["error"]
    assert third.headers["retry-after"] == "1" and took < 1.0
    assert sorted(a.status_code for a in answers) == [200, 200]


def test_a_request_whose_client_left_is_not_scored():
    """Abandoned requests were scored anyway: a small request waited 15 s behind them."""
    model = Gate()
    answers: list = []
    with running(create_app(model)) as url:
        first = post_in_thread(f"{url}/score", one("first"), answers)
        wait_until(lambda: model.batches)
        with pytest.raises(httpx.ReadTimeout):  # this client leaves while the model is busy
            httpx.post(f"{url}/score", json=one("abandoned"), timeout=0.5)
        time.sleep(0.3)  # the server sees the connection close
        model.release.set()
        first.join(15)
        last = httpx.post(f"{url}/score", json=one("last"), timeout=10)
    assert last.status_code == 200 and answers[0].status_code == 200
    assert model.batches == [["first"], ["last"]]


def test_a_request_not_scored_within_request_timeout_is_a_json_503():
    model = Gate()
    with running(create_app(model, request_timeout=0.5)) as url:
        start = time.monotonic()
        answer = httpx.post(f"{url}/score", json=one("slow"), timeout=10)
        took = time.monotonic() - start
        model.release.set()
    assert answer.status_code == 503 and "request_timeout=0.5 s" in answer.json()["error"]
    assert 0.4 < took < 2.0


# ---------------------------------------------------------------- slow clients and connection floods


def raw_exchange(url: str, data: bytes, seconds: float = 5.0) -> tuple[bytes, float]:
    """Send ``data`` on a fresh connection and read until the server closes it (at most ``seconds``)."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=seconds) as conn:
        conn.sendall(data)
        chunks = []
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := conn.recv(65536):
                chunks.append(chunk)
    return b"".join(chunks), time.monotonic() - start


def json_error(raw: bytes) -> tuple[int, str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def guarded(client_timeout: float, max_connections: int):
    from textgym.rewards.server_limits import guarded_protocol

    return guarded_protocol(client_timeout, max_connections)


def test_a_client_that_does_not_send_its_request_head_gets_408_and_is_closed():
    """Slow clients held their connections for ever: 1,100 of them exhausted the server's file descriptors."""
    with running(create_app(Gate(), client_timeout=0.5), http=guarded(0.5, 64)) as url:
        raw, took = raw_exchange(url, b"POST /score HTTP/1.1\r\nHost: x\r\n")  # the head never ends
    assert json_error(raw) == (408, "the request head did not arrive within client_timeout=0.5 s")
    assert took < 2.0


def test_a_client_that_does_not_send_its_body_gets_408():
    with running(create_app(Gate(), client_timeout=0.5), http=guarded(0.5, 64)) as url:
        raw, took = raw_exchange(url, b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert json_error(raw) == (408, "the body did not arrive within client_timeout=0.5 s")
    assert took < 2.0


def test_connections_past_max_connections_get_a_json_503_at_once():
    with running(create_app(Gate()), http=guarded(5.0, 3)) as url:
        host, port = url.removeprefix("http://").split(":")
        held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
        try:
            time.sleep(0.2)
            raw, took = raw_exchange(url, b"")
        finally:
            for conn in held:
                conn.close()
        answer = httpx.get(f"{url}/health", timeout=5)  # the held ones closed: served again
    assert json_error(raw) == (503, "the server holds max_connections=3 connections; retry later") and took < 2.0
    assert answer.status_code == 200


def test_a_flood_of_one_log_line_is_rate_limited(caplog):
    from textgym.rewards.server_limits import RateLimitedLog

    logger = logging.getLogger("textgym.test.flood")
    limiter = RateLimitedLog(interval=0.3)
    logger.addFilter(limiter)
    try:
        with caplog.at_level(logging.WARNING, logger="textgym.test.flood"):
            for i in range(1000):
                logger.warning("model failed on batch %d", i)
            time.sleep(0.35)
            logger.warning("model failed on batch %d", 1000)
    finally:
        logger.removeFilter(limiter)
    assert [r.getMessage() for r in caplog.records] == [
        "model failed on batch 0",
        "model failed on batch 1000 (999 more like it in the last interval)",
    ]
