"""Reward models over HTTP: ``textgym serve-rm`` (a real server process on 127.0.0.1) and the client route.

Only loopback traffic: the servers listen on 127.0.0.1 at a free port; the client's failure modes are
driven through ``httpx.MockTransport`` (no socket at all) or a closed loopback port.
"""

import json
import logging
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from textgym.models import DEFAULT_LM, DEFAULT_RM, load_tokenizer
from textgym.rewards import Episodes, HFRewardModel, HTTPRewardModel, RewardModelError, make_reward_model
from textgym.rewards.server import MicroBatcher, create_app

ROOT = Path(__file__).resolve().parents[1]
TEXTGYM = [sys.executable, "-m", "textgym.cli"]
PROMPTS = ["The movie was", "I watched this film and", "An <pad> odd prompt"]
RESPONSES = [" wonderful, a joy from start to end.", " it was dull and far too long", " fine."]


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, *args: str, env: dict | None = None, command: list[str] | None = None):
    """``textgym serve-rm`` on 127.0.0.1:``port``, returned once ``/health`` answers (at most 120 s)."""
    cmd = command or [*TEXTGYM, "serve-rm", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve-rm exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise AssertionError("serve-rm did not answer /health within 120 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start_server(port, "--threads", "1")
    yield f"http://127.0.0.1:{port}"
    stop(proc)


def episodes(tokenizer=None) -> Episodes:
    tok = tokenizer or load_tokenizer(DEFAULT_LM)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in PROMPTS + RESPONSES]
    return Episodes(list(PROMPTS), list(RESPONSES), ids[: len(PROMPTS)], ids[len(PROMPTS) :])


# ---------------------------------------------------------------- the server process


def test_served_scores_equal_the_local_reward_models(server):
    """Both routes give the in-process model's scores (which re-tokenises text, as the server must)."""
    local = HFRewardModel(DEFAULT_RM).score(episodes())
    for route in ("score", "get_reward"):
        remote = make_reward_model(f"{server}/{route}")
        assert isinstance(remote, HTTPRewardModel)
        np.testing.assert_allclose(remote.score(episodes()), local, rtol=1e-5, atol=1e-5)
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["reward_model"] == "rm"
    assert remote.norm is not None and remote.norm.std == pytest.approx(health["norm"]["std"])


def test_an_env_with_the_url_scores_as_the_local_env(server):
    """reward_model=URL in gym.make: the same scores, standardised with the served model's stored mean/std."""
    infos = []
    for rm in (f"{server}/score", str(DEFAULT_RM)):
        env = gym.make("TextRLHF-v0", max_new_tokens=4, reward_model=rm, reward_timeout=30)
        env.reset(seed=0, options={"prompt": PROMPTS[0]})
        for action in (7, 8, 9, 10):
            _, _, terminated, _, info = env.step(action)
        assert terminated
        infos.append(info)
        env.close()
    assert infos[0]["rm_score"] == pytest.approx(infos[1]["rm_score"], abs=1e-5)
    assert infos[0]["score_reward"] == pytest.approx(infos[1]["score_reward"], abs=1e-5)


def test_a_request_over_the_size_limits_is_refused_with_413(server):
    too_many = httpx.post(f"{server}/get_reward", json={"query": ["x"] * 1025})
    assert too_many.status_code == 413 and "at most 1024" in too_many.json()["error"]
    too_big = httpx.post(f"{server}/get_reward", content=b'{"query": ["' + b"x" * (17 << 20) + b'"]}')
    assert too_big.status_code == 413 and "bytes" in too_big.json()["error"]


def test_the_load_bench_measures_the_server(server):
    """bench/rm_server_load.py's measurement, on the shared server with a small bounded load."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rm_server_load", ROOT / "bench" / "rm_server_load.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.load(server, batch=4, clients=3, requests=9, seconds=120)
    assert result["requests"] == 9 and result["batch"] == 4
    assert 0 < result["p50_ms"] <= result["p99_ms"]
    assert result["episodes_per_s"] == pytest.approx(4 * result["req_per_s"])
    assert 4 <= result["episodes_per_call"] <= 12  # whole requests, at most the three clients' joined


def run_cli(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_waits_for_a_restarted_server_and_equals_an_uninterrupted_run(tmp_path):
    """Decision: the client retries connection failures (~40 s of backoff), so a server restarted in that
    time costs the run nothing; a longer outage stops it with the RewardModelError, and ``--resume`` goes on."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/score"
    train = [*TEXTGYM, "train", "--config", "tiny", "--total-episodes", "32", "--max-new-tokens", "8",
             "--reward-model", url, "--threads", "1"]  # fmt: skip
    proc = start_server(port, "--threads", "1")
    try:
        run_cli([*train, "--out", str(tmp_path / "straight")])
        run = subprocess.Popen([*train, "--out", str(tmp_path / "restarted")], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
        rows = tmp_path / "restarted" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (rows.exists() and rows.read_text().strip()) and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.05)
        stop(proc)  # after iteration 1 of 4: the next rollouts find no server
        time.sleep(1.0)
        proc = start_server(port, "--threads", "1")
        _, stderr = run.communicate(timeout=300)
    finally:
        stop(proc)
    assert run.returncode == 0, stderr[-3000:]
    # the first failure is a refused connection, or a dropped one if a request was in flight at the kill
    assert re.search(rf"reward model at {re.escape(url)}: \w+Error.*; retry 1 of 8", stderr), stderr[-3000:]
    straight, restarted = metrics(tmp_path / "straight"), metrics(tmp_path / "restarted")
    assert len(restarted) == 4
    for a, b in zip(straight, restarted):
        assert {k: a[k] for k in ("score", "gold_score", "kl")} == {k: b[k] for k in ("score", "gold_score", "kl")}


def readme_commands() -> list[list[str]]:
    """The two commands of the README's "A reward model on another machine" block, as argument lists."""
    text = (ROOT / "README.md").read_text().split("### A reward model on another machine", 1)[1]
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.strip().splitlines()]


def test_the_readme_commands_serve_and_train(tmp_path):
    """The README's two terminals, as written but for the port (a free one) and the output folder (in tmp)."""
    serve, train = readme_commands()
    assert serve[:2] == [".venv/bin/textgym", "serve-rm"] and train[:2] == [".venv/bin/textgym", "train"]
    port = str(free_port())
    serve = [*TEXTGYM, *(a.replace("8000", port) for a in serve[1:])]
    train = [*TEXTGYM, *(a.replace("8000", port).replace("runs/tiny-remote", str(tmp_path / "run")) for a in train[1:])]
    proc = start_server(int(port), command=serve)
    try:
        done = run_cli(train)
        out = done.stdout
        assert not re.search(r"Warning\b", done.stderr), done.stderr[-3000:]  # as tests/test_docs.py asks of commands
        calls = httpx.get(f"http://127.0.0.1:{port}/health").json()["score_calls"]
    finally:
        stop(proc)
    assert len(metrics(tmp_path / "run")) == 2 and '"iteration": 2' in out
    assert calls >= 2  # the run's episodes were scored by the server


# ---------------------------------------------------------------- the app in process


def constant_rm(prompts, responses):
    """Scores the response alone: its length, so a test can tell which text was scored."""
    return [float(len(r)) for r in responses]


def test_the_textgym_route_carries_prompt_and_response_apart():
    """A response-only reward model works over /score; /get_reward hands it prompt + response as one text."""
    with TestClient(create_app(make_reward_model(constant_rm))) as client:
        split = client.post("/score", json={"prompts": ["abc"], "responses": ["de"]}).json()["rewards"]
        joined = client.post("/get_reward", json={"query": ["abcde"]}).json()["rewards"]
    assert split == [2.0] and joined == [5.0]


def test_the_openrlhf_route_splits_each_query_at_the_prompt_openrlhf_sends_and_answers_as_openrlhf_does():
    """Issue 37.8: OpenRLHF sends ``prompts`` beside ``query`` (prompt + response) and reads ``rewards``,
    ``scores`` and ``extra_logs``; the route ignored ``prompts``, so a response-only model scored the prompt too.
    """
    body = {"query": ["<s>abcde", "xyz"], "prompts": ["abc", "x"], "labels": ["", ""]}
    with TestClient(create_app(make_reward_model(constant_rm))) as client:
        answer = client.post("/get_reward", json=body).json()
    assert answer == {"rewards": [2.0, 2.0], "scores": [2.0, 2.0], "extra_logs": {}}


@pytest.mark.parametrize(
    ("body", "pattern"),
    [
        ({"query": ["abcde"], "prompts": ["zz"]}, "query[0] does not contain prompts[0] ('zz')"),
        ({"query": ["abcde"], "prompts": ["a", "b"]}, "'query' holds 1 items and 'prompts' 2"),
    ],
)
def test_an_openrlhf_request_whose_prompts_do_not_match_is_refused(body, pattern):
    with TestClient(create_app(make_reward_model(constant_rm))) as client:
        answer = client.post("/get_reward", json=body)
    assert answer.status_code == 422 and pattern in answer.json()["error"]


@pytest.mark.parametrize(
    ("body", "status", "pattern"),
    [
        (b"not json", 400, "not valid JSON"),
        (b'["a"]', 422, "must be a JSON object"),
        (b'{"query": "one string"}', 422, "'query' must be a list of strings"),
        (b'{"prompts": ["a"], "responses": ["b", "c"]}', 422, "'prompts' holds 1 items and 'responses' 2"),
        (b'{"prompts": ["a"], "responses": ["b"], "response_ids": [[1, "x"]]}', 422, "'response_ids' must be 1 lists"),
    ],
)
def test_malformed_requests_get_a_status_and_a_json_message(body, status, pattern):
    route = "/get_reward" if b"query" in body else "/score"
    with TestClient(create_app(make_reward_model(constant_rm))) as client:
        answer = client.post(route, content=body)
    assert answer.status_code == status and pattern in answer.json()["error"]


def test_a_failing_model_is_a_500_with_its_message():
    def nan_rm(prompts, responses):
        return [math.nan] * len(prompts)

    with TestClient(create_app(make_reward_model(nan_rm))) as client:
        answer = client.post("/score", json={"prompts": ["a"], "responses": ["b"]})
    assert answer.status_code == 500 and "scores must be finite" in answer.json()["error"]


def test_the_server_asks_for_its_api_key():
    with TestClient(create_app(make_reward_model(constant_rm), api_key="s3cret")) as client:
        refused = client.post("/score", json={"prompts": ["a"], "responses": ["b"]})
        ok = client.post("/score", json={"prompts": ["a"], "responses": ["b"]},
                         headers={"Authorization": "Bearer s3cret"})  # fmt: skip
    assert refused.status_code == 401 and "s3cret" not in refused.text
    assert ok.status_code == 200 and ok.json()["rewards"] == [1.0]


def batched(requests: list[list[str]], model, max_batch: int) -> tuple[list, int]:
    """Score ``requests`` concurrently through one MicroBatcher; returns (results, score calls)."""
    import asyncio

    async def main():
        batcher = MicroBatcher(model, max_batch=max_batch, max_wait=0.05)
        batcher.queue = asyncio.Queue()
        task = asyncio.create_task(batcher.run())
        eps = [Episodes(["p"] * len(r), r, [[]] * len(r), [[]] * len(r)) for r in requests]
        results = await asyncio.gather(*(batcher.score(e) for e in eps), return_exceptions=True)
        task.cancel()
        return results, batcher.calls

    return asyncio.run(main())


def test_concurrent_requests_are_scored_in_one_call():
    sizes = []

    def rm(prompts, responses):
        sizes.append(len(responses))
        return constant_rm(prompts, responses)

    requests = [["a" * i] * 2 for i in range(10)]
    results, calls = batched(requests, make_reward_model(rm), max_batch=64)
    assert calls == 1 and sizes == [20]
    assert [list(r) for r in results] == [[float(i)] * 2 for i in range(10)]
    sizes.clear()
    _, calls = batched(requests, make_reward_model(rm), max_batch=6)  # whole requests up to 6 episodes
    assert sizes == [6, 6, 6, 2] and calls == 4


def test_a_bad_request_in_a_batch_fails_alone():
    def rm(prompts, responses):
        return [math.nan if r == "bad" else 1.0 for r in responses]

    results, _ = batched([["ok"], ["bad"], ["ok", "ok"]], make_reward_model(rm), max_batch=64)
    assert list(results[0]) == [1.0] and list(results[2]) == [1.0, 1.0]
    assert isinstance(results[1], RewardModelError) and "must be finite" in str(results[1])


# ---------------------------------------------------------------- the client's failure modes


def mock(handler, **kwargs) -> HTTPRewardModel:
    """A client of ``handler`` (scoring requests only: ``/health`` answers 404, as an OpenRLHF server's)."""

    def route(request):
        return httpx.Response(404) if request.url.path == "/health" else handler(request)

    return HTTPRewardModel("http://rm.test:9/score", transport=httpx.MockTransport(route), backoff=0.001,
                           max_backoff=0.001, **kwargs)  # fmt: skip


def scored(model, n: int = 2, timeout=None):
    from textgym.rewards import score_checked

    eps = Episodes(["p"] * n, ["r"] * n, [[1]] * n, [[2]] * n)
    return score_checked(model, eps, timeout=timeout)


def test_a_wrong_length_answer_is_refused():
    model = mock(lambda request: httpx.Response(200, json={"rewards": [1.0]}))
    with pytest.raises(RewardModelError, match=r"'http://rm.test:9/score' returned shape \(1,\) for 2 episodes"):
        scored(model)


def test_a_non_finite_answer_is_refused():
    model = mock(lambda request: httpx.Response(200, text='{"rewards": [1.0, NaN]}'))
    with pytest.raises(RewardModelError, match=r"returned nan for episode 1 .*scores must be finite"):
        scored(model)


def test_an_answer_without_rewards_names_what_came_back():
    model = mock(lambda request: httpx.Response(200, json={"scores": [1.0, 2.0]}))
    with pytest.raises(RewardModelError, match=r"answered HTTP 200 with .*scores.*expected JSON \{\"rewards\""):
        scored(model)


def test_5xx_answers_are_retried_until_one_succeeds(caplog):
    answers = [httpx.Response(503, text="loading"), httpx.Response(502, text="bad gateway"),
               httpx.Response(200, json={"rewards": [0.5, -0.5]})]  # fmt: skip
    model = mock(lambda request: answers.pop(0))
    with caplog.at_level(logging.WARNING, logger="textgym.rewards.http"):
        np.testing.assert_array_equal(scored(model), [0.5, -0.5])
    assert not answers and "HTTP 503" in caplog.text and "retry 2 of 8" in caplog.text


def test_5xx_after_every_retry_is_one_error_naming_the_url_and_the_answer():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(500, json={"error": "CUDA out of memory"})

    with pytest.raises(RewardModelError, match=r"at http://rm.test:9/score failed 3 attempt\(s\); the last: HTTP 500 "
                       r".*CUDA out of memory"):  # fmt: skip
        scored(mock(handler, retries=2))
    assert len(calls) == 3


def test_a_4xx_answer_is_not_retried():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(401, json={"error": "missing or wrong API key"})

    with pytest.raises(RewardModelError, match=r"answered HTTP 401 .*missing or wrong API key"):
        scored(mock(handler))
    assert len(calls) == 1


def test_a_refused_connection_names_the_url():
    url = f"http://127.0.0.1:{free_port()}/get_reward"  # nothing listens there
    model = HTTPRewardModel(url, retries=2, backoff=0.01)
    with pytest.raises(RewardModelError, match=rf"at {re.escape(url)} failed 3 attempt\(s\); the last: ConnectError"):
        scored(model)


def test_the_env_reward_timeout_is_the_request_timeout():
    seen = []

    def handler(request):
        seen.append(request.extensions["timeout"]["read"])
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(RewardModelError, match=r"did not answer within reward_timeout=0.25 s \(ReadTimeout\)"):
        scored(mock(handler), timeout=0.25)
    assert seen == [0.25]  # asked once: a slow model is not asked again


def test_the_api_key_header_is_sent_and_never_shown(monkeypatch, caplog):
    monkeypatch.setenv("TEXTGYM_RM_API_KEY", "s3cret-key")
    headers = []

    def handler(request):
        headers.append(request.headers.get("authorization"))
        return httpx.Response(503, text="busy")

    model = mock(handler, retries=1)
    with caplog.at_level(logging.DEBUG), pytest.raises(RewardModelError) as err:
        scored(model)
    assert headers == ["Bearer s3cret-key"] * 2
    assert "s3cret" not in str(err.value) and "s3cret" not in caplog.text and "s3cret" not in repr(model)
    monkeypatch.delenv("TEXTGYM_RM_API_KEY")
    model = mock(lambda request: httpx.Response(200, json={"rewards": [request.headers.get("authorization", "none")]}))
    with pytest.raises(RewardModelError, match="'none'"):  # no key set: no header (the echo is not a float)
        scored(model, n=1)


def test_the_openrlhf_route_sends_prompt_plus_response_and_the_textgym_route_both_apart():
    bodies = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"rewards": [0.0, 0.0]})

    eps = Episodes(["a", "b"], ["c", "d"], [[1], [2]], [[3], [4]])
    for path in ("get_reward", "score"):
        HTTPRewardModel(f"http://u:pw@rm.test/{path}", transport=httpx.MockTransport(handler)).score(eps)
    assert bodies == [{"query": ["ac", "bd"]},
                      {"prompts": ["a", "b"], "responses": ["c", "d"], "prompt_ids": [[1], [2]],
                       "response_ids": [[3], [4]]}]  # fmt: skip
    assert HTTPRewardModel("http://u:pw@rm.test/score").name == "http://rm.test/score"  # no credentials shown


def test_a_failed_request_leaves_the_env_step_retryable():
    """The env undoes a step whose remote scoring failed; the retry scores the same episode."""
    answers = [httpx.Response(503, text="restarting")] * 2 + [httpx.Response(200, json={"rewards": [0.25]})]
    env = gym.make("TextRLHF-v0", max_new_tokens=3, reward_model=mock(lambda r: answers.pop(0), retries=1),
                   normalize_reward=False, gold_scorer=None)  # fmt: skip
    env.reset(seed=0, options={"prompt": "The movie was"})
    env.step(7)
    with pytest.raises(RewardModelError, match="HTTP 503"):
        env.step(env.unwrapped.eos_token_id)
    _, _, terminated, _, info = env.step(env.unwrapped.eos_token_id)
    assert terminated and info["rm_score"] == 0.25


def test_a_vector_env_sends_one_request_per_step_that_finishes_episodes():
    """Every episode that ends at a step goes in that step's one request: no request per episode."""
    from collections import Counter

    import torch

    from textgym.episodes import collect_episodes, make_episode_envs
    from textgym.policies import LMSampler

    sizes = []

    def handler(request):
        n = len(json.loads(request.content)["responses"])
        sizes.append(n)
        return httpx.Response(200, json={"rewards": [0.5] * n})

    envs = make_episode_envs("TextRLHF-v0", 8, max_new_tokens=6, reward_model=mock(handler), normalize_reward=False)
    policy = LMSampler.for_env(envs.unwrapped.model, envs, generator=torch.Generator().manual_seed(0))
    done = collect_episodes(envs, policy, seed=0)
    envs.close()
    finished_at = Counter(int(n) for n in done["response_length"])  # the step each episode ended on
    assert sizes == [finished_at[step] for step in sorted(finished_at)]
    assert sum(sizes) == 8 and (done["rm_score"] == 0.5).all()
