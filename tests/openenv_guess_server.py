"""A real OpenEnv server for the adapter's tests: guess-the-number built with openenv-core's own server classes.

Run as a script (``openenv_guess_server.py [PORT [MAX_SESSIONS]]``), it binds 127.0.0.1 on PORT (default: a free
one), prints the port on its first line of stdout and serves ``create_app(GuessEnvironment, ...,
max_concurrent_envs=MAX_SESSIONS)`` (default 32) with uvicorn until killed. Why a process of its own: the tests kill it
mid-episode to drop the connection, as a crashed server would.

The game: ``reset(seed=s)`` draws the target from 1..5 with ``random.Random(s)`` and opens with
``Game s: ...`` (so a test sees the seed arrive); each step reads the first integer of the message and answers
``Turn k: Higher.`` / ``Lower.`` (reward 0.1) or ``Correct!`` (reward 1.0, done), ``Say a number ...`` (0.0)
for no number; the game is over after 5 turns. The turn number in every reply shows a step applied twice.

Faults, for the failure tests: when the file named by ``$OPENENV_GUESS_FAULTS`` exists at a step, it is read
and deleted (one fault per file written): ``error`` makes the step raise (the server answers an error
message), ``hang S`` makes it sleep S seconds first. With ``$OPENENV_GUESS_NEEDS_KEY`` set, building the
environment fails unless ``$GUESS_API_KEY`` is set, as for an environment behind an API.
"""

from __future__ import annotations

import os
import random
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

LOW, HIGH, TURNS = 1, 5, 5
FAULTS_ENV = "OPENENV_GUESS_FAULTS"
NEEDS_KEY_ENV = "OPENENV_GUESS_NEEDS_KEY"  # set: building the environment fails without GUESS_API_KEY


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str = ""


class GuessEnvironment(Environment):
    """Guess a number from 1 to 5 in 5 turns; the target is drawn from the reset's seed."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # each WebSocket session has its own instance: nothing is shared

    def __init__(self):
        if os.environ.get(NEEDS_KEY_ENV) and not os.environ.get("GUESS_API_KEY"):
            raise RuntimeError("this game needs GUESS_API_KEY")  # as an env behind an API would
        super().__init__()
        self._state = State(step_count=0)
        self.target, self.over = LOW, True

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.target, self.over = random.Random(seed).randint(LOW, HIGH), False
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text=f"Game {seed}: guess my number from {LOW} to {HIGH} in {TURNS} turns.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        _fault()
        if self.over:
            raise RuntimeError("the game is over; reset starts a new one")
        self._state.step_count += 1
        turn = self._state.step_count
        found = re.search(r"-?\d+", action.message)
        if found is None:
            text, reward = f"Say a number from {LOW} to {HIGH}.", 0.0
        elif int(found[0]) == self.target:
            text, reward = "Correct!", 1.0
        else:
            text, reward = ("Higher." if int(found[0]) < self.target else "Lower."), 0.1
        self.over = reward == 1.0 or turn >= TURNS
        return GuessObservation(text=f"Turn {turn}: {text}", reward=reward, done=self.over)

    @property
    def state(self) -> State:
        return self._state


def _fault() -> None:
    """Play the fault written in ``$OPENENV_GUESS_FAULTS``, once."""
    path = os.environ.get(FAULTS_ENV)
    if not path or not Path(path).exists():
        return
    fault = Path(path).read_text().split()
    Path(path).unlink()
    if fault[0] == "error":
        raise RuntimeError("the guess server failed")
    if fault[0] == "hang":
        time.sleep(float(fault[1]))


def main(port: int = 0, max_sessions: int = 32) -> None:
    serve(create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=max_sessions), port)


def serve(app: Any, port: int = 0) -> None:
    """Serve ``app`` on 127.0.0.1:``port`` (0: a free one, held from the bind on, so no other process can take it
    in between), after printing the port."""
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server takes its killed one's port
    sock.bind(("127.0.0.1", port))
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":  # openenv_guess_server.py [PORT [MAX_SESSIONS]]
    sys.exit(main(*map(int, sys.argv[1:])))
