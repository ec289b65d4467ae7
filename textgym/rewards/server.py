"""Serving a reward model over HTTP (``textgym serve-rm``): FastAPI routes, a micro-batcher, uvicorn.

Needs the ``serve`` extra (``pip install 'textgym[serve]'``); nothing else in textgym imports this module.

Routes:

- ``POST /get_reward`` — OpenRLHF's protocol: ``{"query": [prompt + response, ...], "prompts": [...]}`` →
  ``{"rewards": [...], "scores": [...], "extra_logs": {}}`` (what OpenRLHF's own ``serve_rm`` answers; ``scores``
  equal ``rewards``; ``labels`` are not read). Each query is split after the first occurrence of its prompt
  (what precedes it, e.g. a BOS token the decode kept, is dropped); without ``prompts`` a query is scored as a
  response with an empty prompt, which for a prompt + response model is the same text.
- ``POST /score`` — textgym's: ``{"prompts": [...], "responses": [...]}`` (optionally ``prompt_ids`` and
  ``response_ids``, the client env's token ids, for models that count tokens) → ``{"rewards": [...]}``.
- ``GET /health`` → ``{"status": "ok", "reward_model": NAME, "score_calls": N, "norm": {...} or null}``
  (``norm``: the score mean/std stored beside the model, which the client hands to the env).

Requests that arrive while the model is busy are joined into one ``score`` call of up to ``max_batch``
episodes (whole requests; a request larger than that is scored alone): one forward for many small
clients. Every failure is an HTTP status with ``{"error": message}``: 400 for malformed (or too deeply
nested) JSON, 401 without the API key the server was started with, 408 for a client that does not send
its request within ``client_timeout``, 413 for a body, episode count or episode over the limits (an
episode longer than the reward model's context, ``max_tokens``), 422 for fields of the wrong type or
length (or text that is not valid Unicode), 429 (with ``Retry-After``) while ``max_pending`` requests
already wait, 500 when the model fails or returns anything but one finite float per episode, 503 for a
request not scored within ``request_timeout`` or a connection past ``max_connections``
(:mod:`textgym.rewards.server_limits`). A request whose client has left is not scored; the server's
log lines are rate-limited (one per kind every 10 s).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from asyncio import FIRST_COMPLETED
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from textgym.rewards.base import Episodes, RewardModel, RewardModelError, RewardNorm, score_checked
from textgym.rewards.http import API_KEY_ENV
from textgym.rewards.server_limits import RateLimitedLog, guarded_protocol, raise_open_files_limit

MAX_BODY_BYTES = 16 << 20  # 16 MiB: 1024 episodes of ~4k tokens of text with their ids
MAX_ITEMS = 1024
MAX_PENDING = 64  # requests queued or being scored; more get 429 (a client retries, the queue stays short)
CLIENT_TIMEOUT = 10.0  # seconds a client has to send its request head, and again its body
REQUEST_TIMEOUT = 60.0  # seconds a request may wait and be scored in all
MAX_CONNECTIONS = 512  # open connections; past it a new one gets 503 (a file descriptor each)
CHARS_PER_TOKEN = 32  # past max_tokens x this many characters an episode is refused without tokenising it

__all__ = ["MAX_BODY_BYTES", "MAX_ITEMS", "MicroBatcher", "RequestError", "context_limit", "create_app", "serve"]

log = logging.getLogger(__name__)
log.addFilter(RateLimitedLog())  # a failure repeated by every request costs a line per 10 s, not a disk


class RequestError(Exception):
    """A request the server refuses: its HTTP status, a message for the client and any headers (Retry-After)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers


class ClientGone(Exception):
    """The client closed its connection before its scores were ready: nothing is sent, nothing more scored."""


class MicroBatcher:
    """Joins concurrent requests' episodes into one ``score`` call, run on a single worker thread.

    Why one thread: the model is not re-entrant and its forward already uses every core (or the GPU);
    batching is what raises throughput, not parallel calls.

    Args:
        model: the reward model.
        max_batch: episodes per joined call (whole requests are joined while they fit).
        max_wait: seconds the first request of a batch waits for companions (0: only those already queued).
    """

    def __init__(self, model: RewardModel, max_batch: int = 64, max_wait: float = 0.002):
        self.model, self.max_batch, self.max_wait = model, max_batch, max_wait
        self.queue: asyncio.Queue | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="textgym-rm")
        self.calls = 0  # score calls made (tests and /health read it)
        self.pending = 0  # requests the server has queued or is scoring (it answers 429 past its limit)

    async def score(self, episodes: Episodes) -> np.ndarray:
        """The scores of ``episodes``, computed in a batch with whatever else is queued.

        Cancelled (its client left, or its time ran out) before its batch starts, it is not scored.
        """
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((episodes, future))
        return await future

    async def run(self) -> None:
        """The batching loop (one task per server)."""
        loop = asyncio.get_running_loop()
        carried = None  # a request that did not fit the previous batch starts the next one
        while True:
            first, carried = carried or await self.queue.get(), None
            if first[1].done():  # cancelled: nobody waits for these scores
                continue
            batch, size = [first], len(first[0])
            deadline = loop.time() + self.max_wait
            while size < self.max_batch:
                item = await self._next(deadline - loop.time())
                if item is None:
                    break
                if item[1].done():
                    continue
                if size + len(item[0]) > self.max_batch:
                    carried = item
                    break
                batch.append(item)
                size += len(item[0])
            await self._score_batch(batch)

    async def _next(self, wait: float) -> tuple[Episodes, asyncio.Future] | None:
        """The next queued request, waiting at most ``wait`` seconds for one (None: none came)."""
        try:
            return self.queue.get_nowait()
        except asyncio.QueueEmpty:
            if wait <= 0:
                return None
        try:
            return await asyncio.wait_for(self.queue.get(), wait)
        except TimeoutError:
            return None

    async def _score_batch(self, batch: list[tuple[Episodes, asyncio.Future]]) -> None:
        """Score the joined batch; on failure score each request alone, so only the faulty one fails."""
        loop = asyncio.get_running_loop()
        batch = [item for item in batch if not item[1].done()]  # a client may have left while it waited
        if not batch:
            return
        try:
            scores = await loop.run_in_executor(self.executor, self._checked, join([e for e, _ in batch]))
        except RewardModelError as err:
            if len(batch) == 1:
                _settle(batch[0][1], error=err)
                return
            for item in batch:
                await self._score_batch([item])
            return
        start = 0
        for episodes, future in batch:
            _settle(future, result=scores[start : start + len(episodes)])
            start += len(episodes)

    def _checked(self, episodes: Episodes) -> np.ndarray:
        self.calls += 1
        return score_checked(self.model, episodes)


def join(parts: list[Episodes]) -> Episodes:
    """One :class:`Episodes` holding every part's episodes in order."""
    return Episodes(*(sum((getattr(p, f) for p in parts), []) for f in ("prompts", "responses", "prompt_ids",
                                                                       "response_ids")))  # fmt: skip


def _settle(future: asyncio.Future, result: Any = None, error: Exception | None = None) -> None:
    """Resolve ``future`` unless its client has gone (a cancelled future takes no result)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _strings(body: dict[str, Any], key: str, limit: int) -> list[str]:
    """``body[key]`` as a list of str, checked: 422 for a wrong type, 413 past ``limit`` items."""
    value = body.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RequestError(422, f"{key!r} must be a list of strings, got {type(value).__name__}")
    if len(value) > limit:
        raise RequestError(413, f"{key!r} holds {len(value)} items; at most {limit} per request")
    for i, text in enumerate(value):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # JSON's "\\ud800" escape: a lone surrogate no tokenizer encodes
            raise RequestError(422, f"{key}[{i}] is not valid Unicode ({err.reason} at character {err.start}); "
                               "send UTF-8 text") from None  # fmt: skip
    return value


def _ids(body: dict[str, Any], key: str, n: int) -> list[list[int]] | None:
    """``body[key]`` as ``n`` lists of int token ids, or None when absent."""
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, list) and len(value) == n
    ok = ok and all(isinstance(row, list) and all(isinstance(t, int) for t in row) for row in value)
    if not ok:
        raise RequestError(422, f"{key!r} must be {n} lists of int token ids (one per episode)")
    return value


def parse_episodes(route: str, body: Any, tokenizer, limit: int = MAX_ITEMS) -> Episodes:
    """The :class:`Episodes` a request body describes (``route`` is ``get_reward`` or ``score``).

    Raises:
        RequestError: naming the field and what is allowed.
    """
    if not isinstance(body, dict):
        raise RequestError(422, f"the body must be a JSON object, got {type(body).__name__}")
    if route == "get_reward":
        prompts, responses = _split_queries(_strings(body, "query", limit), body, limit)
    else:
        prompts, responses = _strings(body, "prompts", limit), _strings(body, "responses", limit)
        if len(prompts) != len(responses):
            raise RequestError(422, f"'prompts' holds {len(prompts)} items and 'responses' {len(responses)}; "
                               "give one prompt per response")  # fmt: skip
    prompt_ids = _ids(body, "prompt_ids", len(prompts))
    response_ids = _ids(body, "response_ids", len(responses))
    if prompt_ids is None:
        prompt_ids = _encode(tokenizer, prompts)
    if response_ids is None:
        response_ids = _encode(tokenizer, responses)
    return Episodes(prompts, responses, prompt_ids, response_ids)


def _split_queries(queries: list[str], body: dict[str, Any], limit: int) -> tuple[list[str], list[str]]:
    """(prompts, responses) of OpenRLHF's queries: each split after its prompt, when the body sends ``prompts``.

    Why: OpenRLHF sends the prompt beside each prompt + response query; a response-only reward model must
    score the response alone, and a prompt + response model gets the same text either way.
    """
    if body.get("prompts") is None:
        return [""] * len(queries), queries
    prompts = _strings(body, "prompts", limit)
    if len(prompts) != len(queries):
        raise RequestError(422, f"'query' holds {len(queries)} items and 'prompts' {len(prompts)}; "
                           "give one prompt per query")  # fmt: skip
    responses = []
    for i, (query, prompt) in enumerate(zip(queries, prompts, strict=True)):
        at = query.find(prompt)
        if at < 0:
            raise RequestError(422, f"query[{i}] does not contain prompts[{i}] ({prompt[:80]!r}); each query "
                               "must be its prompt followed by the response")  # fmt: skip
        responses.append(query[at + len(prompt) :])
    return prompts, responses


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids for a model that reads them when the client sent none (empty without a tokenizer)."""
    if tokenizer is None or not texts:
        return [[] for _ in texts]
    return tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (see :func:`create_app` for each)."""

    max_items: int = MAX_ITEMS
    max_body_bytes: int = MAX_BODY_BYTES
    max_tokens: int | None = None
    max_pending: int = MAX_PENDING
    client_timeout: float = CLIENT_TIMEOUT
    request_timeout: float = REQUEST_TIMEOUT

    def __post_init__(self):
        for name in ("max_items", "max_body_bytes", "max_tokens", "max_pending"):
            value = getattr(self, name)
            if not (value is None and name == "max_tokens") and not (type(value) is int and value >= 1):
                allowed = "an int >= 1" + ', "auto" or None' * (name == "max_tokens")
                raise ValueError(f"{name}={value!r} must be {allowed}")
        for name in ("client_timeout", "request_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")):
                raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")


def context_limit(model: RewardModel) -> int | None:
    """The reward model's context in tokens: its transformer's ``max_position_embeddings`` (None: not one)."""
    limit = getattr(getattr(getattr(model, "model", None), "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_lengths(episodes: Episodes, tokenizer, max_tokens: int | None) -> None:
    """413 for an episode whose prompt + response + EOS is over ``max_tokens`` tokens of ``tokenizer``.

    Why: a model run past its context reads positions it was never trained on, and its attention costs
    grow with the square of the length: one 96 KB query took 14 s and 988 MiB (issue 37.7). Text longer
    than ``CHARS_PER_TOKEN`` characters a token is refused before it is tokenised (that costs time too).
    """
    if max_tokens is None or tokenizer is None:
        return
    texts = [p + r for p, r in zip(episodes.prompts, episodes.responses)]
    for i, text in enumerate(texts):
        if len(text) > max_tokens * CHARS_PER_TOKEN:
            raise RequestError(413, f"episode {i} holds {len(text)} characters of prompt + response, more than "
                               f"max_tokens={max_tokens} tokens (the reward model's context) can hold")  # fmt: skip
    ids = tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    for i, row in enumerate(ids):
        if len(row) + 1 > max_tokens:
            raise RequestError(413, f"episode {i} is {len(row) + 1} tokens of prompt + response + EOS; at most "
                               f"max_tokens={max_tokens} (the reward model's context)")  # fmt: skip


def create_app(model: RewardModel, tokenizer=None, max_batch: int = 64, max_items: int = MAX_ITEMS,
               max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None, max_tokens: int | str | None = "auto",
               max_pending: int = MAX_PENDING, client_timeout: float = CLIENT_TIMEOUT,
               request_timeout: float = REQUEST_TIMEOUT):  # fmt: skip
    """The FastAPI app serving ``model``.

    Args:
        tokenizer: encodes the texts of a request that carries no token ids (None: empty ids).
        max_batch: episodes per joined ``score`` call.
        max_items: episodes per request (more: 413).
        max_body_bytes: bytes per request body (more: 413).
        api_key: when set, requests must carry ``Authorization: Bearer <api_key>`` (else 401).
        max_tokens: tokens of prompt + response + EOS per episode, counted by the model's own tokenizer
            (else ``tokenizer``); more: 413. ``"auto"``: the model's context (:func:`context_limit`); None: no cap.
        max_pending: requests waiting or being scored at once; more: 429 with ``Retry-After``.
        client_timeout: seconds the client has to send its body (more: 408).
        request_timeout: seconds a request may wait and be scored (more: 503); a request whose client leaves
            first is dropped, unscored unless its batch had started.
    """
    limits = Limits(max_items, max_body_bytes, context_limit(model) if max_tokens == "auto" else max_tokens,
                    max_pending, client_timeout, request_timeout)  # fmt: skip
    batcher = MicroBatcher(model, max_batch=max_batch)

    @asynccontextmanager
    async def lifespan(app):
        batcher.queue = asyncio.Queue()
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="textgym reward model", lifespan=lifespan)
    app.state.batcher, app.state.limits = batcher, limits
    name = getattr(model, "name", type(model).__name__)
    service = _Service(batcher, tokenizer, getattr(model, "tokenizer", None) or tokenizer, limits, api_key)

    @app.post("/get_reward")
    async def get_reward(request: Request) -> Response:
        return await service.handle("get_reward", request)

    @app.post("/score")
    async def score(request: Request) -> Response:
        return await service.handle("score", request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        norm = getattr(model, "norm", None)  # the client standardises scores with it, as the env does in process
        return {"status": "ok", "reward_model": name, "score_calls": batcher.calls, "pending": batcher.pending,
                "norm": None if norm is None else dict(RewardNorm(*norm)._asdict())}  # fmt: skip

    return app


@dataclass(frozen=True)
class _Service:
    """What the scoring routes share: the batcher, the tokenizers, the limits and the API key."""

    batcher: MicroBatcher
    tokenizer: Any  # encodes texts sent without token ids
    counter: Any  # counts an episode's tokens as the model will read them (its own tokenizer, if it has one)
    limits: Limits
    api_key: str | None

    async def handle(self, route: str, request: Request) -> Response:
        """One scoring request, answered with its rewards or a JSON error, whatever goes wrong."""
        try:
            _authorize(request, self.api_key)
            body = await _read_json(request, self.limits)
            episodes = parse_episodes(route, body, self.tokenizer, self.limits.max_items)
            check_lengths(episodes, self.counter, self.limits.max_tokens)
            scores = await _scored(request, self.batcher, episodes, self.limits) if len(episodes) else np.zeros(0)
        except RequestError as err:
            return JSONResponse({"error": str(err)}, status_code=err.status, headers=err.headers)
        except RewardModelError as err:
            log.warning("%s: HTTP 500: %s", route, err)
            return JSONResponse({"error": str(err)}, status_code=500)
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        except Exception as err:  # every failure is JSON for the client; the log keeps the traceback (rate-limited)
            log.exception("%s: HTTP 500 (unexpected %s)", route, type(err).__name__)
            return JSONResponse({"error": f"internal error ({type(err).__name__}: {err})"}, status_code=500)
        rewards = [float(s) for s in scores]
        if route == "get_reward":  # OpenRLHF reads scores (for dynamic filtering) and extra_logs beside rewards
            return JSONResponse({"rewards": rewards, "scores": rewards, "extra_logs": {}})
        return JSONResponse({"rewards": rewards})


async def _scored(request: Request, batcher: MicroBatcher, episodes: Episodes, limits: Limits) -> np.ndarray:
    """The scores of ``episodes``, unless ``max_pending`` requests already wait (429), they are not ready within
    ``request_timeout`` (503) or the client leaves first (:class:`ClientGone`); either way they are not scored."""
    if batcher.pending >= limits.max_pending:
        log.warning("busy: %d requests pending; answered 429", batcher.pending)
        raise RequestError(429, f"the server is busy: max_pending={limits.max_pending} requests are waiting; retry "
                           "after the Retry-After seconds", headers={"Retry-After": "1"})  # fmt: skip
    batcher.pending += 1  # counted here, before any await: requests arriving together all see it
    work = asyncio.ensure_future(batcher.score(episodes))
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, gone}, timeout=limits.request_timeout, return_when=FIRST_COMPLETED)
    finally:
        batcher.pending -= 1
        gone.cancel()
        work.cancel()  # a no-op once it is done; else its place in the queue is dropped
    if work in done:
        return work.result()
    if gone in done:
        raise ClientGone
    log.warning("a request was not scored within request_timeout=%g s; answered 503", limits.request_timeout)
    raise RequestError(503, f"not scored within request_timeout={limits.request_timeout:g} s (the server is busy); "
                       "retry later", headers={"Retry-After": "1"})  # fmt: skip


async def _disconnect(request: Request) -> None:
    """Return when the client closes its connection (the body is read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _authorize(request: Request, api_key: str | None) -> None:
    """401 unless the request carries the server's API key (compared in constant time)."""
    if api_key and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {api_key}"):
        raise RequestError(401, f"missing or wrong API key: send 'Authorization: Bearer <key>' (the client reads "
                           f"the key from ${API_KEY_ENV})")  # fmt: skip


async def _read_json(request: Request, limits: Limits) -> Any:
    """The request body parsed as JSON: 413 past ``max_body_bytes``, 408 not sent within ``client_timeout``, 400
    if not JSON (or nested past Python's recursion limit)."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the body has {declared} bytes; at most {limit} per request")
    try:
        raw = await asyncio.wait_for(_body(request, limit), limits.client_timeout)
    except TimeoutError:
        raise RequestError(408, f"the body did not arrive within client_timeout={limits.client_timeout:g} s",
                           headers={"Connection": "close"}) from None  # fmt: skip
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(400, f"the body is not valid JSON ({err})") from None
    except RecursionError:
        raise RequestError(400, "the body's JSON is nested too deeply; send a flat object of lists") from None


async def _body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body declares no length: count as it comes
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the body exceeds {limit} bytes per request")
        chunks.append(chunk)
    return b"".join(chunks)


def serve(model: RewardModel, host: str = "127.0.0.1", port: int = 8000, tokenizer=None, max_batch: int = 64,
          max_items: int = MAX_ITEMS, max_body_bytes: int = MAX_BODY_BYTES, max_tokens: int | str | None = "auto",
          max_pending: int = MAX_PENDING, client_timeout: float = CLIENT_TIMEOUT,
          request_timeout: float = REQUEST_TIMEOUT, max_connections: int = MAX_CONNECTIONS) -> None:  # fmt: skip
    """Serve ``model`` with uvicorn until interrupted; the API key, if any, comes from ``$TEXTGYM_RM_API_KEY``.

    Each connection must send its request head within ``client_timeout`` (else 408) and at most
    ``max_connections`` are open at once (else 503), within the process's open-files limit, which is raised
    to its hard limit first (:mod:`textgym.rewards.server_limits`).
    """
    import uvicorn

    app = create_app(model, tokenizer, max_batch=max_batch, max_items=max_items, max_body_bytes=max_body_bytes,
                     api_key=os.environ.get(API_KEY_ENV) or None, max_tokens=max_tokens, max_pending=max_pending,
                     client_timeout=client_timeout, request_timeout=request_timeout)  # fmt: skip
    files = raise_open_files_limit()
    connections = min(max_connections, max(files - 64, 1))  # the model's files, logs and the listener need some
    for name in ("uvicorn.error", "asyncio"):  # accept errors and handler tracebacks: one line per kind per 10 s
        logging.getLogger(name).addFilter(RateLimitedLog())
    uvicorn.run(app, host=host, port=port, log_level="warning", http=guarded_protocol(client_timeout, connections),
                timeout_keep_alive=5)  # fmt: skip
