"""partner="openenv:<url>" against a real OpenEnv server (openenv-core 0.3.0's create_app, in a subprocess).

The server plays guess-the-number (tests/openenv_guess_server.py): the target is drawn from the reset's seed, the
opening names the seed, and every reply names its turn, so a step played twice on the server shows.
"""

from __future__ import annotations

import copy
import gc
import http.server
import os
import pickle
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import textgym  # noqa: F401  (registers the ids)
from textgym.partners import PartnerError, make_partner
from textgym.partners.openenv import OpenEnvPartner

SERVER = Path(__file__).with_name("openenv_guess_server.py")
TURN = dict(max_turn_tokens=4, max_new_tokens=60)


class Server:
    """One OpenEnv server process (the guess game unless ``command`` says otherwise): its URL, the file that
    injects its next fault, and how to stop it."""

    def __init__(self, faults: Path, port: int = 0, max_sessions: int = 32, command: list[str] | None = None,
                 **env: str):  # fmt: skip
        self.faults, self.log = faults, faults.with_suffix(".log")  # the server's stderr: its tracebacks, if any
        env = {**os.environ, "OPENENV_GUESS_FAULTS": str(faults), **env}
        command = command or [sys.executable, str(SERVER), str(port), str(max_sessions)]
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        line = self.proc.stdout.readline()
        assert line.strip().isdigit(), f"the server did not start:\n{self.log.read_text()[-3000:]}"
        self.port = int(line)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while not _answers(self.port):  # the port is bound before uvicorn serves it
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.1)

    def fault(self, text: str) -> None:
        self.faults.write_text(text)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("openenv") / "fault")
    yield s
    s.stop()


def make(url: str, **kwargs):
    return gym.make("TextMultiTurn-v0", partner=f"openenv:{url}", **{**TURN, **kwargs})


def say(env, text: str) -> list[int]:
    """The actions of a turn that says ``text``: its tokens, then the stop token that ends the turn."""
    base = env.unwrapped
    return [*base.tokenizer.encode(text, add_special_tokens=False), base.eos_token_id]


def play_turn(env, text: str):
    for a in say(env, text):
        out = env.step(a)
    return out


def target(seed: int) -> int:
    return random.Random(seed).randint(1, 5)  # as the server draws it


def opening(env, obs) -> str:
    base = env.unwrapped
    P = base.max_prompt_tokens
    return base.tokenizer.decode(obs["input_ids"][:P][obs["attention_mask"][:P] == 1], skip_special_tokens=True)


# ---------------------------------------------------------------- episodes


def test_a_seeded_game_gets_its_seed_pays_each_turn_into_the_info_and_ends_when_the_server_says_done(server):
    env = make(server.url)
    obs, _ = env.reset(seed=0, options={"partner_seed": 7})
    assert opening(env, obs) == "Game 7: guess my number from 1 to 5 in 5 turns."
    goal, rewards = target(7), []
    for guess in range(1, goal + 1):
        obs, reward, done, truncated, info = play_turn(env, str(guess))
        rewards.append(info["turn_reward"])
        expected = "Correct!" if guess == goal else "Higher."
        assert info["reply"] == f"Turn {guess}: {expected}" and done == (guess == goal) and not truncated
    assert rewards == [0.1] * (goal - 1) + [1.0]
    assert info["turns"] == goal and info["turn_reward_sum"] == pytest.approx(0.1 * (goal - 1) + 1.0)
    assert info["conversation"][-1] == {"role": "assistant", "content": str(goal)}


def test_the_same_seed_gives_the_same_episode_also_on_a_new_session(server):
    def episode(env, seed):
        obs, _ = env.reset(seed=seed)
        rng, steps, done = np.random.default_rng(0), [], False
        while not done:
            obs, reward, done, _, info = env.step(int(rng.choice(say(env, str(rng.integers(1, 6))))))
            steps.append((obs["input_ids"].copy(), reward, info.get("reply")))
        return steps

    env = make(server.url)
    first = episode(env, 3)
    again, other = episode(env, 3), episode(make(server.url), 3)
    assert any(reply for *_, reply in first)  # the server answered turns
    for a, b, c in zip(first, again, other, strict=True):
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[0], c[0])
        assert a[1:] == b[1:] == c[1:]


def test_each_slot_plays_its_own_game_on_its_own_session(server):
    seeds = [7, next(s for s in range(8, 100) if target(s) != target(7))]
    for partner in (f"openenv:{server.url}", OpenEnvPartner(server.url)):  # by name, and an instance deep-copied
        envs = gym.make_vec("TextMultiTurn-v0", num_envs=2, vectorization_mode="vector_entry_point",
                            partner=partner, **TURN)  # fmt: skip
        obs, _ = envs.reset(seed=0, options={"partner_seed": seeds})
        for i in (0, 1):
            assert opening(envs, {k: v[i] for k, v in obs.items()}).startswith(f"Game {seeds[i]}: guess")
        replies = [[], []]
        for guess in range(1, 6):
            for a in say(envs.unwrapped, str(guess)):
                obs, reward, done, _, info = envs.step(np.array([a, a]))
            for slot in (0, 1):
                if info.get("_reply", [False, False])[slot]:
                    replies[slot].append(info["reply"][slot])
            if done.any():
                break
        first_done = min(target(s) for s in seeds)
        for slot in (0, 1):
            assert replies[slot][: first_done - 1] == [f"Turn {k}: Higher." for k in range(1, first_done)]
        assert done.tolist() == [target(s) == first_done for s in seeds]


def test_a_copy_of_a_partner_is_a_new_session_on_the_same_server(server):
    partner = OpenEnvPartner(server.url, observation_field="text")
    twin, thawed = copy.deepcopy(partner), pickle.loads(pickle.dumps(partner))  # as Ray or a subprocess env gets it
    for other in (twin, thawed):
        assert (other.base_url, other.observation_field) == (server.url, "text") and other is not partner
    partner.reset(seed=7, prompt="")
    twin.reset(seed=7, prompt="")
    conversation = [{"role": "user", "content": "."}, {"role": "assistant", "content": "1"}]
    assert partner.reply(conversation) == twin.reply(conversation) == ("Turn 1: Higher.", 0.1, False)
    assert partner.reply(conversation) == ("Turn 1: Higher.", 0.1, False)  # a repeated call does not step again
    partner.close()
    with pytest.raises(RuntimeError, match="is over .*or was never started.*reset\\(\\) starts one"):
        partner.reply([*conversation, {"role": "user", "content": "x"}, {"role": "assistant", "content": "2"}])


def test_a_forked_child_does_not_use_its_parents_session_and_opens_its_own_at_reset(server):
    partner = OpenEnvPartner(server.url)
    partner.reset(seed=7, prompt="")
    conversation = [{"role": "user", "content": "."}, {"role": "assistant", "content": "9"}]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what happened through the pipe, then leave without running pytest's exit
        try:
            try:
                partner.reply(conversation)
                out = "stepped on the parent's socket"
            except ConnectionError as err:
                out = str(err)
            partner.reset(seed=7, prompt="")
            out += " | " + repr(partner.reply(conversation))
        except BaseException as err:
            out = f"{type(err).__name__}: {err}"
        os.write(write, out.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = pipe.read()
    os.waitpid(pid, 0)
    assert re.search(rf"ended \(it belongs to process {os.getpid()}, not this fork\).* \| \('Turn 1: Lower\.'", out), (
        out
    )
    assert partner.reply(conversation) == ("Turn 1: Lower.", 0.1, False)  # the parent's own game, untouched


class Picky(OpenEnvPartner):
    """Reads no reply that says ``Higher``: an answer the partner cannot play."""

    def text(self, observation):
        if "Higher" in observation["text"]:
            raise KeyError("no board in the observation")
        return super().text(observation)


def test_an_answer_that_cannot_be_read_ends_the_episode_until_reset(server):
    partner = Picky(server.url)
    partner.reset(seed=7, prompt="")
    conversation = [{"role": "user", "content": "."}, {"role": "assistant", "content": "1"}]
    with pytest.raises(KeyError, match="no board"):
        partner.reply(conversation)
    with pytest.raises(
        ConnectionError, match=r"ended \(its answer could not be read: 'no board.*reset\(\) starts a new"
    ):
        partner.reply(conversation)  # the server stepped: sending the turn again would play it twice
    assert partner.reset(seed=7, prompt="").startswith("Game 7:")
    assert partner.reply([*conversation[:1], {"role": "assistant", "content": "9"}]) == ("Turn 1: Lower.", 0.1, False)


def test_the_env_passes_gymnasium_sb3_and_torchrl_checkers(server):
    from stable_baselines3.common.env_checker import check_env as sb3_check_env
    from torchrl.envs import GymWrapper
    from torchrl.envs.utils import check_env_specs

    check_env(make(server.url).unwrapped, skip_render_check=True)
    sb3_check_env(make(server.url).unwrapped, warn=True)
    check_env_specs(GymWrapper(make(server.url)), seed=0)
    vec = gym.make_vec("TextMultiTurn-v0", num_envs=2, vectorization_mode="vector_entry_point",
                       autoreset_mode="disabled", partner=f"openenv:{server.url}", **TURN)  # fmt: skip
    check_env_specs(GymWrapper(vec), seed=0)


def test_openenvs_own_echo_template_plays_with_the_default_fields(tmp_path):
    """``openenv init``'s environment (OpenEnv's echo template), served as generated: its text fields are found in
    its schema, and its rewards (0.1 per character said) reach the info. Its ``reset()`` takes no seed, so the
    server drops the one sent: documented, not detectable on the wire."""
    bin_only = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no `uv`: init skips `uv lock`, offline
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_t", "--output-dir", str(tmp_path)],
                   check=True, capture_output=True, env=bin_only, timeout=300)  # fmt: skip
    code = (f"import sys; sys.path[:0] = [{str(tmp_path / 'echo_t')!r}, {str(SERVER.parent)!r}]; "
            "from server.app import app; from openenv_guess_server import serve; serve(app)")  # fmt: skip
    echo = Server(tmp_path / "fault", command=[sys.executable, "-c", code])
    try:
        partner = OpenEnvPartner(echo.url)
        assert (partner.action_field, partner.observation_field) == ("message", "echoed_message")
        env = make(echo.url, max_turns=2)
        obs, _ = env.reset(seed=0)
        assert opening(env, obs) == "Echo T environment ready!"
        for _ in range(2):
            *_, done, _, info = play_turn(env, "hello")
            assert info["reply"] == "hello" and info["turn_reward"] == pytest.approx(0.5)
        assert done and info["turn_reward_sum"] == pytest.approx(1.0)
    finally:
        echo.stop()


# ---------------------------------------------------------------- failures


def undone_then_retried(env, server, fault: str, match: str, wait: float = 0.0):
    """One turn played, then the next turn's end fails with ``fault``: the error, the state after, the retry."""
    env.reset(seed=0, options={"partner_seed": 7})
    play_turn(env, "1")
    actions = say(env, "2")
    for a in actions[:-1]:
        obs, *_ = env.step(a)
    server.fault(fault)
    with pytest.raises(PartnerError, match=rf"partner 'openenv:{server.url}' \(env slot 0\)\.reply .*{match}"):
        env.step(actions[-1])
    np.testing.assert_array_equal(env.unwrapped._engine.observation(0)["input_ids"], obs["input_ids"])
    time.sleep(wait)
    return env.step(actions[-1])


def test_an_error_answer_names_the_url_and_the_step_is_undone_so_a_retry_steps_once(server):
    *_, info = undone_then_retried(
        make(server.url), server, "error", "answered with an error: .*the guess server failed"
    )
    assert info["reply"] == "Turn 2: Higher." and info["turn_reward"] == 0.1  # turn 2, not 3: the server stepped once


def test_a_hang_past_partner_timeout_is_undone_and_the_retry_takes_the_one_answer_owed(server):
    env = make(server.url, partner_timeout=1.0)
    start = time.perf_counter()
    *_, info = undone_then_retried(env, server, "hang 2.5", r"did not return within partner_timeout=1\.0 s", wait=2.5)
    assert info["reply"] == "Turn 2: Higher." and time.perf_counter() - start < 30
    *_, info = play_turn(env, "3")
    assert info["reply"] == f"Turn 3: {'Correct!' if target(7) == 3 else 'Higher.'}"


def test_a_server_killed_mid_episode_is_a_lost_session_until_reset(tmp_path):
    victim = Server(tmp_path / "fault")
    try:
        env = make(victim.url)
        env.reset(seed=0, options={"partner_seed": 7})
        play_turn(env, "1")
        actions = say(env, "2")
        for a in actions[:-1]:
            obs, *_ = env.step(a)
        victim.stop()
        lost = rf"partner 'openenv:{victim.url}' \(env slot 0\)\.reply raised ConnectionError: "
        with pytest.raises(PartnerError, match=lost + r"the connection to ws://127\.0\.0\.1:\d+/ws failed"):
            env.step(actions[-1])
        np.testing.assert_array_equal(env.unwrapped._engine.observation(0)["input_ids"], obs["input_ids"])
        with pytest.raises(PartnerError, match=lost + r"the session with .* ended .*reset\(\) starts a new one"):
            env.step(actions[-1])
        victim = Server(tmp_path / "fault", port=victim.port)  # back on the same port: a reset opens a new session
        obs, _ = env.reset(seed=0, options={"partner_seed": 7})
        assert opening(env, obs).startswith("Game 7:")
        assert play_turn(env, "1")[-1]["reply"] == "Turn 1: Higher."
    finally:
        victim.stop()


def test_a_server_at_capacity_is_refused_naming_the_setting_to_raise(tmp_path):
    small = Server(tmp_path / "fault", max_sessions=1)
    try:
        with pytest.raises(PartnerError, match=r"(?s)env slot 1\).reset raised ConnectionError: .*refused the session"
                                               ".*CAPACITY_REACHED.*max_concurrent_envs >= num_envs"):  # fmt: skip
            gym.make_vec("TextMultiTurn-v0", num_envs=2, vectorization_mode="vector_entry_point",
                         partner=f"openenv:{small.url}", **TURN).reset(seed=0)  # fmt: skip
    finally:
        small.stop()


def test_a_server_that_cannot_build_its_environment_is_refused_at_make_naming_the_likely_causes(tmp_path):
    locked = Server(tmp_path / "fault", OPENENV_GUESS_NEEDS_KEY="1")  # its environment needs an API key it lacks
    try:
        with pytest.raises(PartnerError, match=rf"partner 'openenv:{locked.url}' \(env slot 0\)\.reset raised "
                                               r"ConnectionError: .*refused the session: .*FACTORY_ERROR.*missing API "
                                               r"key or package\?\); openenv-core does not say why: build the "
                                               r"Environment class by hand where the server runs"):  # fmt: skip
            make(locked.url)
    finally:
        locked.stop()


def test_a_url_that_does_not_answer_fails_at_make_naming_it():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refuses connections
        start = time.perf_counter()
        with pytest.raises(PartnerError, match=rf"partner='openenv:http://127\.0\.0\.1:{port}': building the partner "
                                               rf"raised ConnectionError: no OpenEnv server answers at "
                                               rf"http://127\.0\.0\.1:{port}"):  # fmt: skip
            make(f"http://127.0.0.1:{port}")
        assert time.perf_counter() - start < 60


def test_a_server_that_is_not_openenv_is_refused_naming_it():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501 to all
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(ValueError, match=rf"partner='openenv:{url}': {url} answered GET /schema with HTTP 501"):
            make_partner(f"openenv:{url}")
    finally:
        httpd.shutdown()


@pytest.mark.parametrize(
    "url, error, match",
    [("127.0.0.1:8000", ValueError, r"base_url='127\.0\.0\.1:8000' is not an OpenEnv server's base URL"),
     ("ftp://h:1", ValueError, r"base_url='ftp://h:1' is not .*\(http, https, ws or wss\)"),
     ("http://h:1/?x=1", ValueError, "without a query or fragment"), (8000, TypeError, r"base_url=8000 \(int\)")],
)  # fmt: skip
def test_a_malformed_url_is_refused_naming_it(url, error, match):
    with pytest.raises(error, match=match):
        OpenEnvPartner(url)


def test_text_fields_are_read_from_the_schema_or_named_and_checked(server):
    partner = OpenEnvPartner(server.url)
    assert (partner.action_field, partner.observation_field) == ("message", "text")
    assert partner.action("[3]") == {"message": "[3]"}
    with pytest.raises(ValueError, match=r"observation_field='board': the observation of .* \(GuessObservation\) "
                                         r"has no string field 'board'; its string fields are \['text'\]"):  # fmt: skip
        OpenEnvPartner(server.url, observation_field="board")
    with pytest.raises(ValueError, match=r"action_field='move': .*its string fields are \['message'\]"):
        OpenEnvPartner(server.url, action_field="move")


def test_without_openenv_the_error_says_which_extra_to_install(monkeypatch, server):
    monkeypatch.setitem(sys.modules, "openenv.core.generic_client", None)  # importing it now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'textgym\[openenv\]'"):
        OpenEnvPartner(server.url)
    with pytest.raises(ValueError, match=rf"^partner='openenv:{server.url}': .*pip install 'textgym\[openenv\]'"):
        make_partner(f"openenv:{server.url}")


def test_a_dropped_partner_ends_its_session_on_the_server(tmp_path):
    single = Server(tmp_path / "fault", max_sessions=1)
    try:
        for _ in range(3):  # one session at a time: each partner's must end before the next one's can start
            partner, deadline = OpenEnvPartner(single.url), time.monotonic() + 20
            while True:
                try:
                    assert partner.reset(seed=1, prompt="").startswith("Game 1:")
                    break
                except ConnectionError as err:  # the last partner's close message may still be on its way
                    assert "CAPACITY_REACHED" in str(err) and time.monotonic() < deadline, err
                    time.sleep(0.2)
            del partner
            gc.collect()
    finally:
        single.stop()
