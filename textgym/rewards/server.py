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
clients. Errors are an HTTP status with ``{"error": message}``: 400 for malformed JSON, 401 without the
API key the server was started with, 413 for a body or episode count over the limit, 422 for fields of
the wrong type or length, 500 when the model fails or returns anything but one finite float per episode.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from textgym.rewards.base import Episodes, RewardModel, RewardModelError, RewardNorm, score_checked
from textgym.rewards.http import API_KEY_ENV

MAX_BODY_BYTES = 16 << 20  # 16 MiB: 1024 episodes of ~4k tokens of text with their ids
MAX_ITEMS = 1024

__all__ = ["MAX_BODY_BYTES", "MAX_ITEMS", "MicroBatcher", "RequestError", "create_app", "serve"]


class RequestError(Exception):
    """A request the server refuses: its HTTP status and a message for the client."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


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

    async def score(self, episodes: Episodes) -> np.ndarray:
        """The scores of ``episodes``, computed in a batch with whatever else is queued."""
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((episodes, future))
        return await future

    async def run(self) -> None:
        """The batching loop (one task per server)."""
        loop = asyncio.get_running_loop()
        carried = None  # a request that did not fit the previous batch starts the next one
        while True:
            batch = [carried or await self.queue.get()]
            carried, size = None, len(batch[0][0])
            deadline = loop.time() + self.max_wait
            while size < self.max_batch:
                item = await self._next(deadline - loop.time())
                if item is None:
                    break
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


def create_app(model: RewardModel, tokenizer=None, max_batch: int = 64, max_items: int = MAX_ITEMS,
               max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None):  # fmt: skip
    """The FastAPI app serving ``model``.

    Args:
        tokenizer: encodes the texts of a request that carries no token ids (None: empty ids).
        max_batch: episodes per joined ``score`` call.
        max_items: episodes per request (more: 413).
        max_body_bytes: bytes per request body (more: 413).
        api_key: when set, requests must carry ``Authorization: Bearer <api_key>`` (else 401).
    """
    batcher = MicroBatcher(model, max_batch=max_batch)

    @asynccontextmanager
    async def lifespan(app):
        batcher.queue = asyncio.Queue()
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()
        batcher.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="textgym reward model", lifespan=lifespan)
    app.state.batcher = batcher
    name = getattr(model, "name", type(model).__name__)

    async def handle(route: str, request: Request) -> JSONResponse:
        try:
            _authorize(request, api_key)
            body = await _read_json(request, max_body_bytes)
            episodes = parse_episodes(route, body, tokenizer, max_items)
            scores = await batcher.score(episodes) if len(episodes) else np.zeros(0)
        except RequestError as err:
            return JSONResponse({"error": str(err)}, status_code=err.status)
        except RewardModelError as err:
            return JSONResponse({"error": str(err)}, status_code=500)
        rewards = [float(s) for s in scores]
        if route == "get_reward":  # OpenRLHF reads scores (for dynamic filtering) and extra_logs beside rewards
            return JSONResponse({"rewards": rewards, "scores": rewards, "extra_logs": {}})
        return JSONResponse({"rewards": rewards})

    @app.post("/get_reward")
    async def get_reward(request: Request) -> JSONResponse:
        return await handle("get_reward", request)

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        return await handle("score", request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        norm = getattr(model, "norm", None)  # the client standardises scores with it, as the env does in process
        return {"status": "ok", "reward_model": name, "score_calls": batcher.calls,
                "norm": None if norm is None else dict(RewardNorm(*norm)._asdict())}  # fmt: skip

    return app


def _authorize(request: Request, api_key: str | None) -> None:
    """401 unless the request carries the server's API key (compared in constant time)."""
    if api_key and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {api_key}"):
        raise RequestError(401, f"missing or wrong API key: send 'Authorization: Bearer <key>' (the client reads "
                           f"the key from ${API_KEY_ENV})")  # fmt: skip


async def _read_json(request: Request, limit: int) -> Any:
    """The request body parsed as JSON, read no further than ``limit`` bytes (413 past it, 400 if not JSON)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the body has {declared} bytes; at most {limit} per request")
    chunks, size = [], 0
    async for chunk in request.stream():  # a chunked body declares no length: count as it comes
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the body exceeds {limit} bytes per request")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as err:
        raise RequestError(400, f"the body is not valid JSON ({err})") from None


def serve(model: RewardModel, host: str = "127.0.0.1", port: int = 8000, tokenizer=None, max_batch: int = 64,
          max_items: int = MAX_ITEMS, max_body_bytes: int = MAX_BODY_BYTES) -> None:  # fmt: skip
    """Serve ``model`` with uvicorn until interrupted; the API key, if any, comes from ``$TEXTGYM_RM_API_KEY``."""
    import uvicorn

    app = create_app(model, tokenizer, max_batch=max_batch, max_items=max_items, max_body_bytes=max_body_bytes,
                     api_key=os.environ.get(API_KEY_ENV) or None)  # fmt: skip
    uvicorn.run(app, host=host, port=port, log_level="warning")
