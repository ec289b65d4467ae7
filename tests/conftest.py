import gc
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import textgym  # noqa: E402,F401  (registers TextRLHF-v0; torch on one core fewer than the machine's)
from textgym.policies import LMSampler  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _collect_cycles_after_each_module():
    """Free what a module's tests left in reference cycles (a model's hooks, an env and its policy): Python's cycle
    collector runs on object counts, not bytes, so a few dropped trainers could hold GBs until it did."""
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _same_threads_after_each_test():
    """A test that sets torch's thread count leaves the next test the default: with one test worker per core, a
    leaked count above textgym's default made every later test of that worker contend with the other worker."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single():
    """One env with a 3-token cap, shared by a module's error and fault tests."""
    e = gym.make("TextRLHF-v0", max_new_tokens=3)
    yield e
    e.close()


@pytest.fixture(scope="module")
def vec():
    """A native vector env of 2 slots with a 3-token cap, shared by a module's tests."""
    e = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point", max_new_tokens=3)
    yield e
    e.close()


@pytest.fixture
def env():
    e = gym.make("TextRLHF-v0", max_new_tokens=12)
    yield e
    e.close()


def ref_policy(env, seed=0, temperature=1.0):
    """The reference model sampling with its own cache, sized for ``env``."""
    g = torch.Generator().manual_seed(seed)
    return LMSampler.for_env(env.unwrapped.model, env, temperature=temperature, generator=g)


def run_episode(env, policy, seed=0, prompt=None):
    """Roll one episode; returns (obs list, actions, rewards, infos)."""
    obs, info = env.reset(seed=seed, options={"prompt": prompt} if prompt is not None else None)
    observations, actions, rewards, infos = [obs], [], [], []
    while True:
        a, _ = policy.act(obs)
        obs, r, term, trunc, info = env.step(int(a[0]))
        observations.append(obs)
        actions.append(int(a[0]))
        rewards.append(r)
        infos.append(info)
        if term or trunc:
            return observations, np.array(actions), np.array(rewards), infos


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """A finished tiny run (one per test module): 2 iterations, a checkpoint after each. Tests work on copies."""
    from textgym.agents.ppo import PPOConfig, train
    from textgym.agents.ppo.config import PRESETS

    out = tmp_path_factory.mktemp("done") / "run"
    train(PPOConfig(**{**PRESETS["tiny"], "out": str(out), "checkpoint_every": 1}))
    return out


@pytest.fixture
def run(done_run, tmp_path):
    """A copy of ``done_run`` a test may change."""
    return Path(shutil.copytree(done_run, tmp_path / "run"))
