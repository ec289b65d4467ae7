"""The reward scale a run pays is decided once, recorded in the run folder, and reused (issue 37.1).

A served reward model's mean/std come from its server's ``/health``; read again on resume, in eval or on a
Ray worker they may differ (or be missing). A loopback server in this process (uvicorn on 127.0.0.1 at a
free port) serves a response-length scorer whose stored mean/std the tests change between runs.
"""

import json
import socket
import threading
import time

import gymnasium as gym
import pytest
import uvicorn

from textgym.agents.evaluate import run_settings
from textgym.agents.ppo import PPOConfig, Trainer, train
from textgym.agents.ppo.config import PRESETS
from textgym.rewards import RewardModelError, RewardNorm
from textgym.rewards.server import create_app


class LengthRM:
    """Scores a response by its length; ``norm`` is what the server reports on /health."""

    name = "length"
    shares_tokenizer = False

    def __init__(self, norm: RewardNorm | None):
        self.norm = norm

    def score(self, episodes):
        return [float(len(r)) for r in episodes.responses]


@pytest.fixture
def served():
    """(url of /score, the served model) on a loopback uvicorn server, stopped after the test."""
    model = LengthRM(RewardNorm(2.0, 4.0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(model), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the loopback server did not start within 30 s"
    yield f"http://127.0.0.1:{port}/score", model
    server.should_exit = True
    thread.join(10)


def tiny(out, url: str, **changes) -> PPOConfig:
    return PPOConfig(**{**PRESETS["tiny"], "out": str(out), "reward_model": url, "gold_scorer": None,
                        "threads": 1, "reward_timeout": 10.0, **changes})  # fmt: skip


def test_a_run_refuses_to_start_when_the_servers_scale_cannot_be_read(tmp_path):
    """The server is down at the start: the run stops naming it, instead of training on raw scores."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/score"  # nothing listens there once closed
    start = time.monotonic()
    with pytest.raises(RewardModelError, match=r"could not be read from .*/health within 1 s.*normalize_reward=False"):
        train(tiny(tmp_path / "run", url, reward_timeout=1.0))
    assert time.monotonic() - start < 60


def test_resume_and_eval_pay_the_recorded_scale_when_the_servers_changed(served, tmp_path):
    url, model = served
    out = tmp_path / "run"
    train(tiny(out, url))  # 2 iterations at the server's (2, 4)
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["normalize_reward"] == [2.0, 4.0]
    model.norm = RewardNorm(100.0, 50.0)  # the server restarted with other statistics
    rows = train(tiny(out, url, total_episodes=24, resume=True))
    resumed = rows[-1]
    # score = (rm_score - mean) / std per episode (no length penalty), so the means obey it too
    assert resumed["score"] == pytest.approx((resumed["rm_score"] - 2.0) / 4.0, abs=1e-9)
    settings = run_settings(str(out / "policy"), given={"reward_model": url})  # `textgym eval --reward-model URL`
    assert settings["normalize_reward"] == [2.0, 4.0]  # what the eval of the policy standardises with
    kwargs = {k: settings[k] for k in ("normalize_reward", "max_new_tokens")}
    env = gym.make(settings["env_id"], reward_model=url, **kwargs)
    assert tuple(env.unwrapped.reward_norm[:2]) == (2.0, 4.0)


def test_ray_workers_get_the_scale_the_learner_read(served, tmp_path):
    """The env overrides the rollout workers are built with carry the scale, not the URL's /health."""
    url, model = served
    trainer = Trainer.create(tiny(tmp_path / "run", url))
    try:
        model.norm = RewardNorm(100.0, 50.0)
        assert trainer.env_overrides["normalize_reward"] == (2.0, 4.0)
        assert trainer.run_info()["normalize_reward"] == [2.0, 4.0]
    finally:
        trainer.close()


def test_eval_does_not_send_episodes_to_a_url_only_the_run_info_names(served, tmp_path):
    """A policy folder is data: its run info naming a server does not choose where eval sends episodes.
    The refusal said the URL was a 'module:attr' that would be imported, which it never is."""
    url, _ = served
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "textgym_run.json").write_text(json.dumps({"reward_model": url, "normalize_reward": [2.0, 4.0]}))
    with pytest.raises(ValueError, match=r"names reward_model='http://.*', a server every evaluated episode would be "
                       r"sent to; .* pass it yourself: --reward-model"):  # fmt: skip
        run_settings(str(policy))
    assert run_settings(str(policy), given={"reward_model": url})["normalize_reward"] == [2.0, 4.0]
