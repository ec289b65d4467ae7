"""A reward model behind an HTTP endpoint: ``reward_model="http://HOST:PORT/get_reward"``.

Two routes are spoken, chosen by the URL's path:

- ``.../get_reward`` — OpenRLHF's ``serve_rm`` protocol: ``{"query": [prompt + response, ...]}`` in,
  ``{"rewards": [...]}`` out. The server sees one text per episode, so it cannot score the response alone.
- anything else (``.../score`` for ``textgym serve-rm``) — textgym's route: ``{"prompts": [...],
  "responses": [...], "prompt_ids": [[...]], "response_ids": [[...]]}`` in, ``{"rewards": [...]}`` out, so a
  reward model that scores the response alone (``default-response``) or counts tokens works as it does in process.

Each finished-episode batch is one request, and the env's ``reward_timeout`` is its total deadline: every
connect, read and write of it ends by then (:mod:`textgym.rewards.deadline`), so a server that drips its
answer cannot stretch it. Connection failures, 5xx and 429 (busy) answers are retried with exponential
backoff (0.5, 1, 2, 4, 8, 8, 8, 8 s by default) within a retry window of the backoffs' sum + 1 s after the
first failure, each connection attempt given at most ``connect_timeout`` (5 s): a restarted server is waited
for about 40 s, a host that does not answer at all about 45 s; then one
:class:`~textgym.rewards.base.RewardModelError` names the URL and what came back.

The score mean/std the env standardises with come from ``GET /health`` (:meth:`HTTPRewardModel.read_norm`),
waited for at most ``reward_timeout``; a server that cannot be read then is an error, never raw scores in
silence (pass ``normalize_reward=False`` or ``(mean, std)`` to run without it). An answer that is not
one finite float per episode is refused by :func:`~textgym.rewards.base.score_checked`, as for a local model.
With ``TEXTGYM_RM_API_KEY`` set, its value is sent as ``Authorization: Bearer ...`` (never logged or shown).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from textgym.errors import short_repr
from textgym.rewards.base import Episodes, RewardModelError, RewardNorm

API_KEY_ENV = "TEXTGYM_RM_API_KEY"
OPENRLHF_PATH = "/get_reward"

__all__ = ["API_KEY_ENV", "HTTPRewardModel", "is_url"]

log = logging.getLogger(__name__)
RETRY_SLACK = 1.0  # seconds the retry window allows beyond its waits: the attempts' own time, when they fail fast
_UNREAD = object()  # read_norm has not succeeded yet


def is_url(text: str) -> bool:
    """Whether ``reward_model=text`` names an HTTP endpoint."""
    return text.startswith(("http://", "https://"))


def _public_url(url: str) -> str:
    """``url`` without user:password, which must not appear in names, logs or errors."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


class HTTPRewardModel:
    """Scores episodes by POSTing them to a reward-model server.

    Args:
        url: ``http(s)://HOST:PORT/get_reward`` (OpenRLHF) or ``http(s)://HOST:PORT/score`` (textgym).
        timeout: seconds each request may take in all when the env gives no ``reward_timeout`` (None: no limit).
        retries: further attempts after a connection failure, a 5xx answer or a 429 (a busy server).
        backoff: seconds before the first retry; doubled each time, at most ``max_backoff``.
        max_backoff: the longest wait between two attempts.
        connect_timeout: seconds each connection attempt may take (a host that does not answer is retried, not
            waited on for the whole ``timeout`` each time).
        api_key_env: the environment variable holding the API key sent as a bearer token (unset: none sent).
        transport: an ``httpx`` transport (tests use ``httpx.MockTransport``); None: the network.

    Raises:
        ValueError: ``url`` is not an http(s) URL with a host, or a retry or timeout setting is out of range.
    """

    shares_tokenizer = False
    # score_checked hands this model the env's reward_timeout instead of waiting for it on a thread:
    # the request itself times out, so nothing is left running when the step is undone.
    enforces_timeout = True

    def __init__(self, url: str, timeout: float | None = 60.0, retries: int = 8, backoff: float = 0.5,
                 max_backoff: float = 8.0, connect_timeout: float = 5.0, api_key_env: str = API_KEY_ENV,
                 transport: Any = None):  # fmt: skip
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"reward_model={url!r} is not an http(s)://HOST[:PORT]/PATH URL")
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ValueError(f"retries={retries!r} must be an int >= 0")
        if not (backoff >= 0 and max_backoff >= backoff):
            raise ValueError(f"backoff={backoff!r}, max_backoff={max_backoff!r}: need 0 <= backoff <= max_backoff")
        for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0" + " or None" * (
                    name == "timeout"))  # fmt: skip
        self.url = url
        self.name = _public_url(url)
        self.openrlhf = parts.path.rstrip("/").endswith(OPENRLHF_PATH)
        self.timeout, self.retries, self.backoff, self.max_backoff = timeout, retries, backoff, max_backoff
        self.connect_timeout = connect_timeout
        # the retries' waits in all: how long a server that is down (or restarting) is waited for after a failure
        self.retry_window = sum(min(backoff * 2**i, max_backoff) for i in range(retries))
        self.api_key_env = api_key_env
        self._transport = transport
        self._client = None
        self._norm: Any = _UNREAD

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its open connection (Ray ships env specs; a fresh client reconnects)."""
        return {**self.__dict__, "_client": None}

    def __repr__(self) -> str:
        return f"HTTPRewardModel({self.name!r})"

    # ------------------------------------------------------------------ the score mean/std
    @property
    def norm(self) -> RewardNorm | None:
        """The served model's stored score mean/std (:meth:`read_norm` within this client's ``timeout``)."""
        return self.read_norm()

    def read_norm(self, timeout: float | None = None) -> RewardNorm | None:
        """The served model's stored score mean/std from ``GET /health``, so the env standardises as in process.

        A server still starting is waited for: refused connections and 5xx answers are retried until
        ``timeout`` seconds have passed (None: this client's ``timeout``, else its retry window). Read once.

        Returns:
            None only for a server that says it stores none: no ``/health`` route (404 or 405, an OpenRLHF
            server) or ``"norm": null``.

        Raises:
            RewardModelError: ``/health`` could not be read in time, or answered something else; it names the
                URL and the way out (``normalize_reward=False`` or ``(mean, std)``): a run silently paid raw
                scores, 4.25x the scale of a standardised one, when a server was down at its start (issue 37.1).
        """
        if self._norm is not _UNREAD:
            return self._norm
        limit = timeout if timeout is not None else self.timeout if self.timeout is not None else self.retry_window
        response, problem = self._get_health(time.monotonic() + limit)
        if response is not None:
            self._norm = self._parse_health(response)
            return self._norm
        raise RewardModelError(
            f"reward_model={self.name!r}: the score mean/std to standardise with could not be read from "
            f"{self._health_url()} within {limit:g} s ({problem}); without them the env would pay raw scores, on "
            "another scale than the run asked for. Start the server (or give it reward_timeout to load), or "
            "choose the scale: normalize_reward=False (raw scores) or normalize_reward=(mean, std)"
        )

    def _health_url(self) -> str:
        parts = urlsplit(self.url)
        path = parts.path.rstrip("/").rpartition("/")[0] + "/health"
        return urlunsplit((parts.scheme, parts.netloc, path, "", ""))

    def _get_health(self, end: float) -> tuple[Any, str]:
        """(the ``/health`` answer, "") once it is 200, 404 or 405; (None, what went wrong) once ``end`` passes."""
        import httpx

        from textgym.rewards.deadline import deadline

        attempt, problem = 0, "no attempt"
        while (left := end - time.monotonic()) > 0:
            try:
                with deadline(left):
                    response = self._open().get(self._health_url(), headers=self._headers(),
                                                timeout=self._timeouts(left))  # fmt: skip
            except httpx.TransportError as err:  # refused, timed out, dropped: a server starting up
                problem = f"{type(err).__name__}: {err}"
            else:
                if response.status_code in (200, 404, 405):
                    return response, ""
                problem = f"HTTP {response.status_code} {short_repr(response.text, 200)}"
                if response.status_code < 500:  # 401, 403...: waiting does not change it
                    break
            wait = min(self.backoff * 2**attempt, self.max_backoff, end - time.monotonic())
            if wait > 0:
                time.sleep(wait)
            attempt += 1
        return None, problem

    def _parse_health(self, response) -> RewardNorm | None:
        """The ``norm`` of a ``/health`` answer: None for no route or ``null``, else a mean and a std > 0."""
        if response.status_code != 200:
            return None
        try:
            stats = response.json()["norm"]
            if stats is None:
                return None
            norm = RewardNorm(float(stats["mean"]), float(stats["std"]), stats.get("max_new_tokens"),
                              stats.get("temperature"))  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError):
            norm = None
        else:
            if math.isfinite(norm.mean) and math.isfinite(norm.std) and norm.std > 0:
                return norm
        raise RewardModelError(
            f"reward_model={self.name!r}: {self._health_url()} answered {short_repr(response.text, 200)}; expected "
            'JSON {"norm": {"mean": float, "std": float > 0} or null}; pass normalize_reward=False or (mean, std)'
        )

    # ------------------------------------------------------------------ scoring
    def payload(self, episodes: Episodes) -> dict[str, Any]:
        """The JSON body of one request for ``episodes`` (the route decides what is sent)."""
        if self.openrlhf:
            return {"query": [p + r for p, r in zip(episodes.prompts, episodes.responses)]}
        return {"prompts": list(episodes.prompts), "responses": list(episodes.responses),
                "prompt_ids": [list(map(int, ids)) for ids in episodes.prompt_ids],
                "response_ids": [list(map(int, ids)) for ids in episodes.response_ids]}  # fmt: skip

    def score(self, episodes: Episodes, timeout: float | None = None) -> list[float]:
        """One POST for the whole batch; returns the ``rewards`` list as the server sent it.

        Args:
            timeout: seconds the request may take in all (the env's ``reward_timeout``); None: this model's
                ``timeout``.

        Raises:
            RewardModelError: the server stayed unreachable or answered 5xx or 429 through the retry window,
                answered another 4xx, did not answer within the timeout, or sent a body without a ``rewards`` list.
        """
        limit = timeout if timeout is not None else self.timeout
        response = self._post(self.payload(episodes), limit)
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("rewards"), list):
            raise RewardModelError(
                f"reward model at {self.name} answered HTTP {response.status_code} with "
                f'{short_repr(response.text, 200)}; expected JSON {{"rewards": [one float per episode]}}'
            )
        return body["rewards"]

    def _post(self, body: dict[str, Any], timeout: float | None):
        """POST ``body``, retrying connection failures, 5xx and 429 answers with backoff within the retry window."""
        failures: list[str] = []
        give_up_at = None  # the retry window runs from the first failure
        for attempt in range(self.retries + 1):
            if attempt:
                give_up_at = give_up_at or time.monotonic() + self.retry_window + RETRY_SLACK
                wait = min(self.backoff * 2 ** (attempt - 1), self.max_backoff, give_up_at - time.monotonic())
                if wait <= 0:  # the attempts took the window's time (connects that time out): done waiting
                    break
                log.warning("reward model at %s: %s; retry %d of %d in %.1f s", self.name, failures[-1], attempt,
                            self.retries, wait)  # fmt: skip
                time.sleep(wait)
            response, failure = self._attempt(body, timeout)
            if response is not None:
                return response
            failures.append(failure)
        raise RewardModelError(
            f"reward model at {self.name} failed {len(failures)} attempt(s); the last: {failures[-1]} (retried for "
            f"{self.retry_window + RETRY_SLACK:g} s after the first failure)"
        )

    def _attempt(self, body: dict[str, Any], timeout: float | None) -> tuple[Any, str]:
        """One POST within ``timeout`` s in all: (the answer, "") or (None, a failure worth a retry)."""
        import httpx

        from textgym.rewards.deadline import deadline

        limits = self._timeouts(timeout)
        try:
            with deadline(timeout):
                response = self._open().post(self.url, json=body, headers=self._headers(), timeout=limits)
        except httpx.ConnectTimeout as err:
            return None, f"connection timed out after {limits.connect:g} s ({err})"
        except httpx.TimeoutException as err:
            raise RewardModelError(
                f"reward model at {self.name} did not answer within reward_timeout={timeout} s "
                f"({type(err).__name__}); the step was undone"
            ) from None
        except httpx.TransportError as err:  # refused, reset, server gone mid-answer: it may come back
            return None, f"{type(err).__name__}: {err}"
        if response.status_code >= 500 or response.status_code == 429:  # 429: a busy server's back-pressure
            return None, f"HTTP {response.status_code} {short_repr(response.text, 200)}"
        if response.status_code >= 400:
            raise RewardModelError(
                f"reward model at {self.name} answered HTTP {response.status_code} {short_repr(response.text, 300)}"
            )
        return response, ""

    def _timeouts(self, total: float | None):
        """httpx's per-operation limits: ``total`` each (the deadline bounds their sum), ``connect_timeout`` apart."""
        import httpx

        connect = self.connect_timeout if total is None else min(self.connect_timeout, total)
        return httpx.Timeout(total, connect=connect)

    def _open(self):
        """The keep-alive ``httpx.Client``, made on first use (and again after unpickling)."""
        import httpx

        from textgym.rewards.deadline import deadline_transport

        if self._client is None:
            # trust_env=False: a reward-model server is a cluster-internal address; an HTTP(S)_PROXY meant for
            # the hub would otherwise carry (and could log) every batch of episodes
            transport = self._transport if self._transport is not None else deadline_transport()
            self._client = httpx.Client(transport=transport, trust_env=False)
        return self._client

    def _headers(self) -> dict[str, str]:
        """The bearer token from ``api_key_env``, read at each request (never stored on the model or logged)."""
        key = os.environ.get(self.api_key_env, "")
        return {"Authorization": f"Bearer {key}"} if key else {}

    def close(self) -> None:
        """Close the connection pool."""
        if self._client is not None:
            self._client.close()
            self._client = None
