"""A reward model behind an HTTP endpoint: ``reward_model="http://HOST:PORT/get_reward"``.

Two routes are spoken, chosen by the URL's path:

- ``.../get_reward`` — OpenRLHF's ``serve_rm`` protocol: ``{"query": [prompt + response, ...]}`` in,
  ``{"rewards": [...]}`` out. The server sees one text per episode, so it cannot score the response alone.
- anything else (``.../score`` for ``textgym serve-rm``) — textgym's route: ``{"prompts": [...],
  "responses": [...], "prompt_ids": [[...]], "response_ids": [[...]]}`` in, ``{"rewards": [...]}`` out, so a
  reward model that scores the response alone (``default-response``) or counts tokens works as it does in process.

Each finished-episode batch is one request. Connection failures and 5xx answers are retried with exponential
backoff (0.5, 1, 2, 4, 8, 8, 8, 8 s by default: a restarted server is waited for about 40 s); then one
:class:`~textgym.rewards.base.RewardModelError` names the URL and what came back. An answer that is not
one finite float per episode is refused by :func:`~textgym.rewards.base.score_checked`, as for a local model.
With ``TEXTGYM_RM_API_KEY`` set, its value is sent as ``Authorization: Bearer ...`` (never logged or shown).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from textgym.rewards.base import Episodes, RewardModelError, RewardNorm
from textgym.utils import short_repr

API_KEY_ENV = "TEXTGYM_RM_API_KEY"
OPENRLHF_PATH = "/get_reward"

__all__ = ["API_KEY_ENV", "HTTPRewardModel", "is_url"]

log = logging.getLogger(__name__)


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
        timeout: seconds each request may take when the env gives no ``reward_timeout`` (None: no limit).
        retries: further attempts after a connection failure or a 5xx answer.
        backoff: seconds before the first retry; doubled each time, at most ``max_backoff``.
        max_backoff: the longest wait between two attempts.
        api_key_env: the environment variable holding the API key sent as a bearer token (unset: none sent).
        transport: an ``httpx`` transport (tests use ``httpx.MockTransport``); None: the network.

    Raises:
        ValueError: ``url`` is not an http(s) URL with a host, or a retry setting is out of range.
    """

    shares_tokenizer = False
    # score_checked hands this model the env's reward_timeout instead of waiting for it on a thread:
    # the request itself times out, so nothing is left running when the step is undone.
    enforces_timeout = True

    def __init__(self, url: str, timeout: float | None = 60.0, retries: int = 8, backoff: float = 0.5,
                 max_backoff: float = 8.0, api_key_env: str = API_KEY_ENV, transport: Any = None):  # fmt: skip
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"reward_model={url!r} is not an http(s)://HOST[:PORT]/PATH URL")
        if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
            raise ValueError(f"retries={retries!r} must be an int >= 0")
        if not (backoff >= 0 and max_backoff >= backoff):
            raise ValueError(f"backoff={backoff!r}, max_backoff={max_backoff!r}: need 0 <= backoff <= max_backoff")
        self.url = url
        self.name = _public_url(url)
        self.openrlhf = parts.path.rstrip("/").endswith(OPENRLHF_PATH)
        self.timeout, self.retries, self.backoff, self.max_backoff = timeout, retries, backoff, max_backoff
        self.api_key_env = api_key_env
        self._transport = transport
        self._client = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its open connection (Ray ships env specs; a fresh client reconnects)."""
        return {**self.__dict__, "_client": None}

    def __repr__(self) -> str:
        return f"HTTPRewardModel({self.name!r})"

    @functools.cached_property
    def norm(self) -> RewardNorm | None:
        """The served model's stored score mean/std, so the env standardises as it would in process.

        Read once from ``GET /health`` beside the scoring route (``textgym serve-rm`` reports it); None for a
        server that has no such route or reports none (an OpenRLHF server), or that cannot be reached now.
        """
        import httpx

        parts = urlsplit(self.url)
        health = urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/").rpartition("/")[0] + "/health", "", ""))
        try:
            response = self._open().get(health, headers=self._headers(), timeout=self.timeout)
            if response.status_code != 200:  # not a textgym server: it stores no statistics
                return None
            stats = response.json().get("norm")
            if stats is None:
                return None
            return RewardNorm(float(stats["mean"]), float(stats["std"]), stats.get("max_new_tokens"),
                              stats.get("temperature"))  # fmt: skip
        except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError) as err:
            log.warning("reward model at %s: no score mean/std read from /health (%s); scores are not standardised",
                        self.name, type(err).__name__)  # fmt: skip
            return None

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
            timeout: seconds for the request (the env's ``reward_timeout``); None: this model's ``timeout``.

        Raises:
            RewardModelError: the server stayed unreachable or answered 5xx after every retry, answered 4xx,
                did not answer within the timeout, or sent a body without a ``rewards`` list.
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
        """POST ``body``, retrying connection failures and 5xx answers with exponential backoff."""
        import httpx

        client = self._open()
        failures = []
        for attempt in range(self.retries + 1):
            if attempt:
                wait = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
                log.warning("reward model at %s: %s; retry %d of %d in %.1f s", self.name, failures[-1], attempt,
                            self.retries, wait)  # fmt: skip
                time.sleep(wait)
            try:
                response = client.post(self.url, json=body, headers=self._headers(), timeout=timeout)
            except httpx.TimeoutException as err:
                if isinstance(err, httpx.ConnectTimeout):
                    failures.append(f"connection timed out ({err})")
                    continue
                raise RewardModelError(
                    f"reward model at {self.name} did not answer within reward_timeout={timeout} s "
                    f"({type(err).__name__}); the step was undone"
                ) from None
            except httpx.TransportError as err:  # refused, reset, server gone mid-answer: it may come back
                failures.append(f"{type(err).__name__}: {err}")
                continue
            if response.status_code >= 500:
                failures.append(f"HTTP {response.status_code} {short_repr(response.text, 200)}")
                continue
            if response.status_code >= 400:
                raise RewardModelError(
                    f"reward model at {self.name} answered HTTP {response.status_code} {short_repr(response.text, 300)}"
                )
            return response
        raise RewardModelError(
            f"reward model at {self.name} failed {self.retries + 1} attempt(s); the last: {failures[-1]}"
        )

    def _open(self):
        """The keep-alive ``httpx.Client``, made on first use (and again after unpickling)."""
        import httpx

        if self._client is None:
            # trust_env=False: a reward-model server is a cluster-internal address; an HTTP(S)_PROXY meant for
            # the hub would otherwise carry (and could log) every batch of episodes
            self._client = httpx.Client(transport=self._transport, trust_env=False)
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
