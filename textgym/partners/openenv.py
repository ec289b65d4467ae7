"""An OpenEnv server's environment as the partner: ``partner="openenv:http://127.0.0.1:8000"``.

The environment runs behind an OpenEnv server (openenv-core's ``create_app`` / ``HTTPEnvServer``); each policy
turn is one ``step`` whose action carries the turn's text, and the observation's text is the user's next turn.
Needs the extra: ``pip install 'textgym[openenv]'`` (openenv-core 0.3.0).

The protocol, as OpenEnv's own client speaks it (``openenv.core.GenericEnvClient``, used here): one WebSocket
per partner at ``<base_url>/ws``, messages ``{"type": "reset", "data": {"seed": s}}`` and ``{"type": "step",
"data": <action fields>}``, answers ``{"type": "observation", "data": {"observation": {...}, "reward": r,
"done": d}}`` or ``{"type": "error", "data": {"message": ..., "code": ...}}``. Why the WebSocket and not
``POST /reset`` + ``POST /step``: in openenv-core 0.3.0 those HTTP routes build a fresh environment for every
request and close it after, so a step never sees the reset's game; only a WebSocket session keeps one
environment instance from reset to the episode's end.

Sessions: each env slot has its own partner and so its own WebSocket session, which the server serves with its
own environment instance. A server takes ``max_concurrent_envs`` sessions (default 1; more only for an
``Environment`` with ``SUPPORTS_CONCURRENT_SESSIONS = True``): serve N slots with at least N. A session opens
at the first ``reset`` and closes with :meth:`OpenEnvPartner.close` or when the partner is garbage-collected.

Seeds: ``reset(seed=s)`` sends ``{"seed": s}``; the server passes it to its environment's ``reset`` only when
that method takes ``seed`` (or ``**kwargs``), and drops it silently otherwise, so an environment whose reset
has no ``seed`` (OpenEnv's ``openenv init`` echo template) is not seeded, and nothing on the wire says so.

Text: the action's text field and the observation's are read from the server's ``GET /schema`` when the
partner is built: the action's one required string field (the echo template's and ``textarena_env``'s
``message``) and the observation's one string field besides ``done``/``reward``/``metadata`` (the template's
``echoed_message``). Name them with ``OpenEnvPartner(url, action_field=..., observation_field=...)`` where a
schema has several, or subclass and override :meth:`OpenEnvPartner.action` / :meth:`OpenEnvPartner.text`
for anything else. A ``None`` reward is 0.0; a bool reward (OpenEnv allows one, as a verdict) is 1.0 or 0.0.

Failures: a URL that does not answer ``GET /schema`` fails when the partner is built (at ``gym.make``). What an
environment needs (a download, the network, an API key) only the server knows: one that cannot build its
environment answers the session ``FACTORY_ERROR`` (without the reason, in openenv-core 0.3.0), an error that
names the likely causes, at the first reset (also at ``gym.make``, which resets a partner to size the opening). At a
step, a dropped connection, an error answer and a call past the env's ``partner_timeout`` reach the env as one
:class:`~textgym.partners.PartnerError` naming ``openenv:<url>``, and the env undoes the step. The server cannot
undo a step, so what a retry of the same turn does depends on the failure: after an error answer it sends the
turn again (the session is intact); after a timeout it waits for the answer to the turn already sent (so the
server's game moves once); after a dropped connection it fails again, naming the lost session, until a
``reset`` opens a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from textgym.errors import short_repr
from textgym.imports import import_optional

__all__ = ["OpenEnvPartner"]

_EXTRA = "pip install 'textgym[openenv]'"
_SCHEMES = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
_OBSERVATION_BASE = {"done", "reward", "metadata"}  # openenv's Observation fields: not the env's text
# error codes after which the server has ended the session (openenv.core.env_server.types.WSErrorCode)
_SESSION_ENDED = {"CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR"}
_HINTS = {
    "CAPACITY_REACHED": "; each env slot holds one session: serve the environment with max_concurrent_envs >= "
    "num_envs (create_app(..., max_concurrent_envs=N), for an Environment with SUPPORTS_CONCURRENT_SESSIONS = True)",
    # openenv-core 0.3.0 drops the factory's exception: neither its answer nor its log says what failed
    "FACTORY_ERROR": "; the server could not build its environment (a download without network, a missing API key "
    "or package?); openenv-core does not say why: build the Environment class by hand where the server runs",
}


def _openenv():
    """openenv-core's client module, imported on first use (it is an optional extra)."""
    return import_optional("openenv.core.generic_client", "OpenEnv environments", "openenv-core", _EXTRA)


def _urls(base_url: Any) -> tuple[str, str]:
    """``(http_url, ws_url)`` of a server's base URL, or a ValueError naming it and the allowed forms."""
    allowed = "an OpenEnv server's base URL such as 'http://127.0.0.1:8000' (http, https, ws or wss)"
    if not isinstance(base_url, str):
        raise TypeError(f"base_url={short_repr(base_url)} ({type(base_url).__name__}) must be a str: {allowed}")
    parts = urlsplit(base_url)
    if parts.scheme not in _SCHEMES or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"base_url={base_url!r} is not {allowed}, without a query or fragment")
    path = parts.path.rstrip("/")
    http = urlunsplit(({"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme), parts.netloc, path, "", ""))
    return http, urlunsplit((_SCHEMES[parts.scheme], parts.netloc, path, "", ""))


def _schemas(http_url: str, timeout: float) -> dict[str, Any]:
    """The server's ``GET /schema`` (action, observation and state JSON schemas); fails fast on a dead URL.

    Raises:
        ConnectionError: nothing answers at ``http_url`` within ``timeout`` seconds.
        ValueError: something answers, but not as an OpenEnv server.
    """
    import httpx  # a dependency of openenv-core

    try:  # trust_env=False: an HTTP(S)_PROXY meant for the internet must not carry a local env server's traffic
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            answer = client.get(f"{http_url}/schema")
    except httpx.HTTPError as err:
        raise ConnectionError(
            f"no OpenEnv server answers at {http_url} ({type(err).__name__}: {err}); start it first "
            "(uvicorn on openenv's create_app(...)) or check the URL"
        ) from err
    try:
        schemas = answer.json() if answer.status_code == 200 else None
    except ValueError:
        schemas = None
    if not isinstance(schemas, dict) or not all(isinstance(schemas.get(k), dict) for k in ("action", "observation")):
        raise ValueError(
            f"{http_url} answered GET /schema with HTTP {answer.status_code} {short_repr(answer.text)}, not an "
            "OpenEnv server's schemas (openenv-core 0.3.0 serves {'action': ..., 'observation': ..., 'state': ...})"
        )
    return schemas


def _string_fields(schema: dict[str, Any], required_only: bool) -> list[str]:
    """The plain ``"type": "string"`` properties of a JSON schema (the required ones only if asked)."""
    required = set(schema.get("required", []))
    return [name for name, prop in schema.get("properties", {}).items()
            if prop.get("type") == "string" and (name in required or not required_only)]  # fmt: skip


def _text_field(schema: dict[str, Any], which: str, given: str | None, http_url: str) -> str:
    """The action's (``which="action"``) or observation's text field: ``given`` checked, or the only candidate.

    Raises:
        ValueError: ``given`` is no string field of the schema, or the schema has no or several candidates;
            the message names the argument and the fields there are.
    """
    argument = f"{which}_field"
    strings = _string_fields(schema, required_only=False)
    if given is not None:
        if given not in strings:
            raise ValueError(f"{argument}={given!r}: the {which} of {http_url} ({schema.get('title')}) has no "
                             f"string field {given!r}; its string fields are {strings}")  # fmt: skip
        found = [given]
    elif which == "action":
        found = _string_fields(schema, required_only=True)
    else:
        found = [name for name in strings if name not in _OBSERVATION_BASE]
    if len(found) != 1:
        raise ValueError(
            f"the {which} of {http_url} ({schema.get('title')}) has {len(found)} candidate text fields {found} "
            f"(string fields: {strings}); name the one that carries the text with {argument}=, or subclass "
            f"OpenEnvPartner and override its {'action' if which == 'action' else 'text'} method"
        )
    if which == "action":
        other = [name for name in schema.get("required", []) if name != found[0]]
        if other:
            raise ValueError(f"the action of {http_url} ({schema.get('title')}) requires {other} beside the text "
                             f"field {found[0]!r}; override OpenEnvPartner.action to fill them")  # fmt: skip
    return found[0]


# ---------------------------------------------------------------- the event loop and the sessions


@functools.cache
def _client_class() -> type:
    """OpenEnv's ``GenericEnvClient``, reading the reason a server gives before it closes a session it refuses.

    Why: a server at capacity accepts the WebSocket, sends ``{"type": "error", ... "CAPACITY_REACHED"}`` and closes
    it; the client's first send then fails on the closed socket, and the reason would go unread. Here a send that
    fails on a closed socket is left to the receive that follows: it reads the reason if one came, else raises the
    closed connection itself.
    """
    from websockets.exceptions import ConnectionClosed

    class Client(_openenv().GenericEnvClient):
        async def _send(self, message: dict[str, Any]) -> None:
            try:
                await super()._send(message)
            except ConnectionClosed:
                pass

    return Client


class _Loop:
    """One daemon thread running the asyncio loop every partner's WebSocket lives on, started on first use.

    Why one loop: OpenEnv's client is async; a thread per partner would cost N threads for N env slots. Why a
    pid check: a forked child (a subprocess vector env, a Ray worker) inherits the loop but not its thread.
    """

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None
    _pid: int | None = None

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        with cls._lock:
            if cls._loop is None or cls._pid != os.getpid():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="textgym-openenv", daemon=True).start()
                cls._loop, cls._pid = loop, os.getpid()
            return cls._loop

    @classmethod
    def running(cls) -> asyncio.AbstractEventLoop | None:
        """This process's loop if it was started, else None."""
        return cls._loop if cls._pid == os.getpid() else None


class _Session:
    """One WebSocket session with the server (OpenEnv's ``GenericEnvClient``), and why it ended, if it did."""

    def __init__(self, ws_url: str, connect_timeout: float):
        # message_timeout_s=None: the env's partner_timeout bounds a call; a client timeout of its own would leave
        # the late answer in the socket, read as the answer to the next message
        self.client = _client_class()(ws_url, connect_timeout_s=connect_timeout, message_timeout_s=None)
        self.ended: str | None = None  # why the server can no longer continue this session's episode
        self.pid = os.getpid()

    def lost(self) -> str | None:
        """Why this session cannot go on here (None: it can): it ended, or it is a forked parent's socket."""
        return self.ended or (f"it belongs to process {self.pid}, not this fork" if self.pid != os.getpid() else None)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """``client.<method>(*args, **kwargs)`` started on the loop; its future."""
        return asyncio.run_coroutine_threadsafe(getattr(self.client, method)(*args, **kwargs), _Loop.get())

    def close(self) -> None:
        """Close the WebSocket on the loop, without waiting (a hung server must not hang the caller)."""
        self.ended = self.ended or "closed"
        loop = _Loop.running()
        if loop is not None:  # else the socket belongs to another process (a fork's parent): nothing to close here
            asyncio.run_coroutine_threadsafe(self.client.disconnect(), loop)


def _close(sessions: list[_Session | None]) -> None:
    """The finalizer of a partner: close its current session (holds no reference to the partner)."""
    if sessions[0] is not None:
        sessions[0].close()


@dataclass(eq=False)
class _Call:
    """A message sent whose answer has not been taken yet: a turn's step (``key``) or a reset."""

    key: Any
    future: concurrent.futures.Future
    session: _Session


# ---------------------------------------------------------------- the partner


class OpenEnvPartner:
    """An OpenEnv server's environment as a partner: the policy's turns are its actions.

    Args:
        base_url: the server's base URL (``"http://127.0.0.1:8000"``; ``ws://`` too).
        action_field: the action field that carries the policy's turn (default: the action schema's one required
            string field).
        observation_field: the observation field whose text is the partner's reply (default: the observation
            schema's one string field besides ``done``, ``reward``, ``metadata``).
        connect_timeout: seconds to wait for ``GET /schema`` at construction and for the WebSocket to open.

    Raises:
        ImportError: openenv-core is not installed (``pip install 'textgym[openenv]'``).
        ConnectionError: nothing answers at ``base_url``.
        ValueError: a malformed URL, a server that is not OpenEnv's, or no single text field to use.

    A copy (``copy.deepcopy``, as ``partner=`` makes for each env slot) or an unpickled partner is a new partner
    on the same server, with a session of its own: a session cannot be copied.
    """

    def __init__(self, base_url: str, *, action_field: str | None = None, observation_field: str | None = None,
                 connect_timeout: float = 10.0):  # fmt: skip
        _openenv()
        self.http_url, self.ws_url = _urls(base_url)
        self.base_url = base_url
        self.name = f"openenv:{base_url}"  # how PartnerError names this partner: the URL
        self._options = {"action_field": action_field, "observation_field": observation_field,
                         "connect_timeout": connect_timeout}  # fmt: skip
        schemas = _schemas(self.http_url, connect_timeout)
        self.action_field = _text_field(schemas["action"], "action", action_field, self.http_url)
        self.observation_field = _text_field(schemas["observation"], "observation", observation_field, self.http_url)
        self._lock = threading.Lock()
        self._sessions: list[_Session | None] = [None]  # a list: the finalizer closes whichever session is current
        self._pending: _Call | None = None
        self._last: tuple[Any, tuple[str, float, bool]] | None = None  # (turn key, its result)
        self._over = True  # no episode until reset
        weakref.finalize(self, _close, self._sessions)

    # ------------------------------------------------------------ the mapping (override for other shapes)

    def action(self, text: str) -> dict[str, Any]:
        """The step's action for the policy's turn ``text``: ``{action_field: text}``."""
        return {self.action_field: text}

    def text(self, observation: dict[str, Any]) -> str:
        """The partner's reply in an observation (the ``observation`` dict of OpenEnv's answer)."""
        text = observation.get(self.observation_field)
        if not isinstance(text, str):
            raise RuntimeError(f"the observation of {self.http_url} has no string {self.observation_field!r}: "
                               f"{short_repr(observation)}")  # fmt: skip
        return text

    # ------------------------------------------------------------ the partner protocol

    def reset(self, *, seed: int, prompt: str) -> str | None:
        """Start a new episode on the server with ``seed``; its opening text (None when empty: keep ``prompt``).

        A session that ended (a dropped connection) or still owes an answer (a call abandoned after a timeout)
        is replaced by a new one first: its server-side episode cannot be continued, and a new episode needs none.
        """
        with self._lock:
            session = self._sessions[0]
            if session is None or session.lost() or self._pending is not None:
                if session is not None:
                    session.close()
                session = self._sessions[0] = _Session(self.ws_url, self._options["connect_timeout"])
            self._last, self._over = None, True
            call = self._pending = _Call(("reset", seed), session.submit("reset", seed=seed), session)
        return self._answer(call)[0] or None

    def reply(self, conversation: list[dict[str, str]]) -> tuple[str, float, bool]:
        """Step the server's environment with the policy's last turn; its reply, reward (None: 0.0) and done.

        Idempotent for a retry: a call with the conversation of the previous one (same length, same last turn)
        returns the previous result, or waits for the answer still owed to it, without stepping again. Why: when
        a step fails (here, in another slot, or in the reward model) the env undoes it and asks again; a second
        step would play the turn twice on the server, which cannot undo one.
        """
        key = (len(conversation), conversation[-1]["content"])
        with self._lock:
            if self._last is not None and self._last[0] == key:
                return self._last[1]
            call = self._pending
            if call is None or call.key != key:
                self._check_can_step(call)
                session = self._sessions[0]
                call = self._pending = _Call(key, session.submit("step", self.action(key[1])), session)
        return self._answer(call)

    def close(self) -> None:
        """End the session with the server (the server then frees its environment instance)."""
        with self._lock:
            _close(self._sessions)
            self._sessions[0], self._pending, self._over = None, None, True

    def _check_can_step(self, pending: _Call | None) -> None:
        """Raise unless a new step may be sent now (called under the lock)."""
        session = self._sessions[0]
        if pending is not None:
            raise RuntimeError(
                f"{self.http_url} still owes the answer to an earlier message ({short_repr(pending.key)}), whose call "
                "was abandoned after a timeout; the server cannot undo it, so only that same turn can be retried "
                "(or reset() starts a new episode)"
            )
        if session is not None and session.lost():
            raise ConnectionError(f"the session with {self.ws_url}/ws ended ({session.lost()}); the server's episode "
                                  "ended with it and cannot be resumed: reset() starts a new one")  # fmt: skip
        if session is None or self._over:
            raise RuntimeError(f"the episode on {self.http_url} is over (or was never started); reset() starts one")

    def _answer(self, call: _Call) -> tuple[str, float, bool]:
        """Wait for ``call``'s answer; record it if ``call`` is still the one owed (a late abandoned call is not)."""
        try:
            result = call.future.result()
        except Exception as err:
            self._settle(call)
            raise self._failure(err, call.session) from err
        try:
            out = (self.text(result.observation), _reward(result.reward, self.http_url), bool(result.done))
        except Exception as err:  # the server stepped, but its answer cannot be played: its episode cannot go on
            call.session.ended = f"its answer could not be read: {err}"
            self._settle(call)
            raise
        with self._lock:
            if self._pending is call:
                self._pending, self._over = None, out[2]
                if call.key[0] != "reset":
                    self._last = (call.key, out)
        return out

    def _settle(self, call: _Call) -> None:
        """``call`` failed: nothing is owed for it any more (unless a newer call took its place)."""
        with self._lock:
            if self._pending is call:
                self._pending = None

    def _failure(self, err: Exception, session: _Session) -> Exception:
        """The error to raise for a failed call; marks the session ended when the server ended it."""
        if isinstance(err, RuntimeError) and str(err).startswith("Server error:"):  # the server's error answer
            code = re.search(r"\(code: (\w+)\)$", str(err))
            if code and code[1] in _SESSION_ENDED:
                session.ended = f"the server ended it: {err}"
                return ConnectionError(f"{self.ws_url}/ws refused the session: {err}{_HINTS.get(code[1], '')}")
            return RuntimeError(f"{self.http_url} answered with an error: {err}")
        session.ended = f"{type(err).__name__}: {err}"  # a dropped connection, a refused connect
        return ConnectionError(f"the connection to {self.ws_url}/ws failed ({type(err).__name__}: {err}); the "
                               "server's episode is lost with it: reset() starts a new one")  # fmt: skip

    # ------------------------------------------------------------ copies

    def __deepcopy__(self, memo: dict) -> OpenEnvPartner:
        return OpenEnvPartner(self.base_url, **self._options)

    def __reduce__(self):
        return _rebuilt, (self.base_url, self._options)


def _rebuilt(base_url: str, options: dict[str, Any]) -> OpenEnvPartner:
    """An unpickled partner: a new one on the same server."""
    return OpenEnvPartner(base_url, **options)


def _reward(reward: Any, http_url: str) -> float:
    """OpenEnv's reward as a float: None (no reward this step) is 0.0, a bool verdict 1.0 or 0.0."""
    if reward is None:
        return 0.0
    if isinstance(reward, bool):
        return float(reward)
    if not isinstance(reward, (int, float)):
        raise RuntimeError(f"{http_url} answered a reward {short_repr(reward)} ({type(reward).__name__}), not a number")
    return float(reward)
