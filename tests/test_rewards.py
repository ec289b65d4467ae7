"""Reward models: every plug-in route, the built-ins, entry points, Bradley-Terry training."""

import json
import random
import sys
import types
from importlib.metadata import EntryPoint

import gymnasium as gym
import numpy as np
import pytest

from textgym.models import DEFAULT_LM, DEFAULT_RM
from textgym.rewards import (
    Episodes,
    HFRewardModel,
    KeywordReward,
    LengthReward,
    VaderScorer,
    WeightedSumReward,
    make_reward_model,
    registry,
    score_checked,
)
from textgym.rewards.training import load_pairs, train_reward_model

EPS = Episodes(
    prompts=["The movie was", "I saw"],
    responses=[" great and fun, I loved it.", " boring and bad."],
    prompt_ids=[[1, 5], [1, 6]],
    response_ids=[[7, 8, 2], [9, 2]],
)


def end_reward(env):
    """Play EOS at once and return the last info."""
    env.reset(seed=0)
    return env.step(env.unwrapped.eos_token_id)[4]


def keyword_fn(prompts, responses):
    return [float("great" in r) for r in responses]


def test_every_route_plugs_into_the_env(monkeypatch):
    module = types.ModuleType("my_rewards")
    module.score = keyword_fn
    module.Factory = LengthReward
    monkeypatch.setitem(sys.modules, "my_rewards", module)
    routes = [keyword_fn, KeywordReward("great"), "vader", "length", "default", str(DEFAULT_RM),
              "my_rewards:score", "my_rewards:Factory"]  # fmt: skip
    for spec in routes:
        env = gym.make("TextRLHF-v0", reward_model=spec, normalize_reward=False, max_new_tokens=4)
        info = end_reward(env)
        assert np.isfinite(info["rm_score"]), spec


def test_entry_point_discovery(monkeypatch):
    ep = EntryPoint(name="from-a-package", value="tests_rm_pkg:reward", group=registry.ENTRY_POINT_GROUP)
    module = types.ModuleType("tests_rm_pkg")
    module.reward = lambda prompts, responses: [3.0] * len(prompts)
    monkeypatch.setitem(sys.modules, "tests_rm_pkg", module)
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep] if group == registry.ENTRY_POINT_GROUP else [])
    assert "from-a-package" in registry.registered_names()
    rm = make_reward_model("from-a-package")
    assert score_checked(rm, EPS).tolist() == [3.0, 3.0]
    env = gym.make("TextRLHF-v0", reward_model="from-a-package", normalize_reward=False, max_new_tokens=4)
    assert end_reward(env)["rm_score"] == 3.0


def test_builtin_scorers():
    assert score_checked(KeywordReward(["great", "fun"]), EPS).tolist() == [2.0, 0.0]
    assert score_checked(KeywordReward(r"bor\w+", regex=True), EPS).tolist() == [0.0, 1.0]
    length = LengthReward(target=3)
    assert score_checked(length, EPS).tolist() == pytest.approx([-(6 - 3) / 3, 0.0])
    vader = score_checked(VaderScorer(), EPS)
    assert vader[0] > 0.5 and vader[1] < -0.3
    both = WeightedSumReward([(2.0, KeywordReward("great")), (1.0, length)])
    assert score_checked(both, EPS).tolist() == pytest.approx([2.0 - 1.0, 0.0])
    with pytest.raises(ValueError, match="target=0"):
        LengthReward(target=0)
    with pytest.raises(ValueError, match="invalid regular expression"):
        KeywordReward("(", regex=True)


def test_hf_reward_model_shares_the_env_tokenizer_and_matches_retokenised_text():
    env = gym.make("TextRLHF-v0", max_new_tokens=4)
    rm = env.unwrapped.reward_model
    assert isinstance(rm, HFRewardModel) and rm.shares_tokenizer
    tok = env.unwrapped.tokenizer
    prompts, responses = ["The movie was"], [" really good"]
    ids = Episodes(prompts, responses, [tok(prompts[0])["input_ids"]],
                   [tok(responses[0], add_special_tokens=False)["input_ids"]])  # fmt: skip
    fresh = HFRewardModel(DEFAULT_RM)  # not bound: re-tokenises the text
    assert not fresh.shares_tokenizer
    assert rm.score(ids)[0] == pytest.approx(fresh.score(ids)[0], abs=1e-5)


def test_load_pairs_names_the_bad_line(tmp_path):
    path = tmp_path / "pairs.jsonl"
    good = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})
    cases = [("{not json", "invalid JSON"), (json.dumps({"prompt": "p", "chosen": "a"}), "missing key 'rejected'"),
             (json.dumps({"prompt": "p", "chosen": "", "rejected": "b"}), "non-empty")]  # fmt: skip
    for line, message in cases:
        path.write_text(good + "\n" + line + "\n")
        with pytest.raises(ValueError, match=rf"pairs.jsonl:2: .*{message}"):
            load_pairs(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pairs(tmp_path / "nope.jsonl")


def test_bradley_terry_learns_a_rule_and_plugs_into_env_and_critic(tmp_path):
    """Chosen responses say 'great', rejected ones 'awful': the learnt RM ranks held-out pairs right."""
    rng = random.Random(0)
    subjects = ["The movie", "The film", "The story", "The ending", "The music", "The actors", "This show"]
    fillers = ["was", "felt", "seemed", "looked", "sounded"]

    def pair():
        s, f = rng.choice(subjects), rng.choice(fillers)
        return {"prompt": s, "chosen": f" {f} great to me.", "rejected": f" {f} awful to me."}

    lines = [pair() for _ in range(160)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = train_reward_model(load_pairs(path), DEFAULT_LM, tmp_path / "rm", epochs=2, lr=5e-4,
                                batch_size=16, progress=False)  # fmt: skip
    assert result.val_accuracy >= 0.9
    env = gym.make("TextRLHF-v0", reward_model=str(tmp_path / "rm"), normalize_reward=False, max_new_tokens=4)
    assert env.unwrapped.reward_model.shares_tokenizer
    from textgym.agents.ppo.models import make_actor, make_critic

    policy = make_actor(env.unwrapped.model)
    critic = make_critic(env.unwrapped.reward_model, policy)
    rm_body = env.unwrapped.reward_model.backbone.state_dict()
    for key, value in critic.base_model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), rm_body[key].numpy())


def test_two_label_classifier_scores_the_chosen_label(tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    m = AutoModelForSequenceClassification.from_pretrained(DEFAULT_LM, num_labels=2, dtype=torch.float32)
    m.config.id2label, m.config.label2id = {0: "NEG", 1: "POS"}, {"NEG": 0, "POS": 1}
    m.config.pad_token_id = 0
    m.save_pretrained(tmp_path / "clf")
    AutoTokenizer.from_pretrained(DEFAULT_LM).save_pretrained(tmp_path / "clf")
    logits = HFRewardModel(tmp_path / "clf", label=0).score(EPS)
    pos = HFRewardModel(tmp_path / "clf", label="POS").score(EPS)
    logp = HFRewardModel(tmp_path / "clf", label="POS", use_logprob=True).score(EPS)
    both = np.stack([logits, pos], -1)
    np.testing.assert_allclose(logp, pos - np.log(np.exp(both).sum(-1)), atol=1e-5)
    with pytest.raises(ValueError, match="label='MAYBE'"):
        HFRewardModel(tmp_path / "clf", label="MAYBE")
    with pytest.raises(ValueError, match="label=5"):
        HFRewardModel(tmp_path / "clf", label=5)
