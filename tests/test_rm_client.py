"""The HTTP reward model's client: its total deadline, its retry window, and the score scale it reads (issue 37.1-2).

Only loopback traffic: raw-socket servers on 127.0.0.1 that misbehave on purpose, each bounded in time,
and ``httpx.MockTransport`` (no socket at all).
"""

import json
import re
import socket
import threading
import time

import gymnasium as gym
import httpx
import pytest

from textgym.envs.checks import resolve_norm
from textgym.rewards import Episodes, HTTPRewardModel, RewardModelError, RewardNorm, score_checked


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scored(model, n: int = 2, timeout=None):
    eps = Episodes(["p"] * n, ["r"] * n, [[1]] * n, [[2]] * n)
    return score_checked(model, eps, timeout=timeout)


class DripServer:
    """Answers each connection with a valid HTTP response, one byte every ``gap`` s (at most ``seconds`` in all)."""

    ANSWER = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n{"rewards": [1, 2]}\n'

    def __init__(self, gap: float, seconds: float = 20.0):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/score"
        self.gap, self.end, self.stop = gap, time.monotonic() + seconds, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(5)
        self.sock.close()

    def _serve(self) -> None:
        while not self.stop.is_set() and time.monotonic() < self.end:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.recv(65536)  # the request (small: it fits one read)
                for byte in self.ANSWER:
                    if self.stop.wait(self.gap) or time.monotonic() > self.end:
                        return
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:  # the client gave up: the next connection
                        break


def test_a_server_dripping_its_answer_is_held_to_the_total_deadline():
    """Issue 37.2: reward_timeout bounded each socket read, so a byte every 2 s passed a 5 s timeout (46 s)."""
    with DripServer(gap=0.15) as server:  # the whole answer takes 13 s
        model = HTTPRewardModel(server.url, retries=0)
        start = time.monotonic()
        with pytest.raises(RewardModelError, match=r"did not answer within reward_timeout=1.0 s \(ReadTimeout\)"):
            scored(model, timeout=1.0)
        took = time.monotonic() - start
    assert took < 1.5, f"a 1 s deadline took {took:.1f} s"


def test_a_host_that_never_accepts_is_given_up_within_the_retry_window():
    """Issue 37.2: each connection attempt waited the whole timeout again (9 attempts of a 60 s reward_timeout:
    9 min, where the docs said about 40 s). Now the retries end with their window: the waits' sum + 1 s."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)  # never accepts: its queue fills
    port = listener.getsockname()[1]
    queued = []
    try:
        for _ in range(8):  # fill the accept queue: the next SYN is dropped, the connect hangs
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            queued.append(s)
        time.sleep(0.1)
        model = HTTPRewardModel(f"http://127.0.0.1:{port}/score", retries=8, backoff=0.1, max_backoff=0.2)
        start = time.monotonic()
        with pytest.raises(RewardModelError, match=r"the last: connection timed out after 1 s"):
            scored(model, timeout=1.0)
        took = time.monotonic() - start
    finally:
        for s in queued:
            s.close()
        listener.close()
    # the first connect (1 s), the window (1.5 s of waits + 1 s), the connect begun at its end (1 s); was 10.5 s
    assert took < 5.0, f"gave up after {took:.1f} s"


# ---------------------------------------------------------------- the score scale from /health


def health_mock(answer, calls: list | None = None) -> HTTPRewardModel:
    """A client whose ``/health`` gives ``answer`` (a Response, or an exception to raise) and scores 0.5 each."""

    def route(request):
        if request.url.path == "/health":
            if calls is not None:
                calls.append(request.extensions["timeout"])
            if isinstance(answer, Exception):
                raise answer
            return answer
        return httpx.Response(200, json={"rewards": [0.5] * len(json.loads(request.content)["responses"])})

    return HTTPRewardModel("http://rm.test:9/score", transport=httpx.MockTransport(route), timeout=0.5,
                           backoff=0.05, max_backoff=0.1)  # fmt: skip


def test_a_server_that_is_down_refuses_the_env_instead_of_raw_scores():
    """Issue 37.1: /health unreachable at env build gave raw scores with a log line: the run paid 4.25x the scale."""
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    model = HTTPRewardModel(url, timeout=0.5, backoff=0.05, max_backoff=0.1)
    health = re.escape(url.replace("/score", "/health"))
    pattern = rf"reward_model='{re.escape(url)}': the score mean/std .* from {health} within 0.5 s \(ConnectError"
    with pytest.raises(RewardModelError, match=pattern + r".*normalize_reward=False"):
        gym.make("TextRLHF-v0", reward_model=model, max_new_tokens=3, gold_scorer=None)


@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        (httpx.Response(503, text="loading the model"), "HTTP 503 'loading the model'"),
        (httpx.Response(401, json={"error": "missing or wrong API key"}), "HTTP 401"),
        (httpx.ReadTimeout("timed out"), "ReadTimeout"),
    ],
)
def test_a_health_answer_without_the_scale_is_an_error_naming_it(answer, shown):
    with pytest.raises(
        RewardModelError,
        match=re.escape(shown) + r".*normalize_reward=False \(raw scores\) or normalize_reward=\(mean, std\)",
    ):
        health_mock(answer).read_norm()


def test_explicit_normalize_reward_needs_no_health():
    calls = []
    model = health_mock(httpx.Response(503), calls)
    env = gym.make("TextRLHF-v0", reward_model=model, max_new_tokens=3, gold_scorer=None, normalize_reward=False)
    assert env.unwrapped.reward_norm is None
    env = gym.make("TextRLHF-v0", reward_model=model, max_new_tokens=3, gold_scorer=None, normalize_reward=(1.0, 2.0))
    assert tuple(env.unwrapped.reward_norm[:2]) == (1.0, 2.0) and calls == []


@pytest.mark.parametrize(
    ("answer", "norm"),
    [
        (httpx.Response(404), None),  # an OpenRLHF server: no /health, no stored scale
        (httpx.Response(200, json={"status": "ok", "norm": None}), None),  # textgym serving a model without one
        (httpx.Response(200, json={"norm": {"mean": 1.5, "std": 2.0, "max_new_tokens": 3}}), RewardNorm(1.5, 2.0, 3)),
    ],
)
def test_a_server_that_stores_no_scale_says_so(answer, norm):
    assert health_mock(answer).read_norm() == norm


def test_a_health_answer_with_a_bad_scale_is_refused():
    with pytest.raises(RewardModelError, match=r"health answered .*\"std\":0.*expected JSON"):
        health_mock(httpx.Response(200, json={"norm": {"mean": 1.0, "std": 0}})).read_norm()


def test_the_health_wait_follows_reward_timeout():
    """A server that is starting is waited for, but no longer than the env's reward_timeout (not the client's 60 s)."""
    url = f"http://127.0.0.1:{free_port()}/score"
    model = HTTPRewardModel(url, timeout=60.0, backoff=0.05, max_backoff=0.1)
    start = time.monotonic()
    with pytest.raises(RewardModelError, match=r"within 0.4 s"):
        resolve_norm(None, model, 3, timeout=0.4)
    assert 0.35 < time.monotonic() - start < 1.5


def test_gym_make_waits_for_health_no_longer_than_reward_timeout():
    """The env's own reading of the scale follows its reward_timeout (it waited the client's 60 s)."""
    url = f"http://127.0.0.1:{free_port()}/score"
    model = HTTPRewardModel(url, timeout=60.0, backoff=0.05, max_backoff=0.1)
    start = time.monotonic()
    with pytest.raises(RewardModelError, match=r"within 0.4 s"):
        gym.make("TextRLHF-v0", reward_model=model, reward_timeout=0.4, max_new_tokens=3, gold_scorer=None)
    assert time.monotonic() - start < 3.0


def test_a_429_answer_is_retried():
    """textgym serve-rm answers 429 past max_pending (issue 37.7): back-pressure, not a failure; the client waited
    for no 4xx and stopped the run."""
    answers = [httpx.Response(429, json={"error": "busy"}, headers={"Retry-After": "1"}),
               httpx.Response(200, json={"rewards": [0.5, -0.5]})]  # fmt: skip

    def route(request):
        return httpx.Response(404) if request.url.path == "/health" else answers.pop(0)

    model = HTTPRewardModel("http://rm.test:9/score", transport=httpx.MockTransport(route), backoff=0.01)
    assert list(scored(model)) == [0.5, -0.5] and not answers
