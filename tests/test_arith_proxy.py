"""reward_model="arithmetic-proxy": a learned, imperfect stand-in for TextArithmetic-v0's verifier, and its build."""

import json
from dataclasses import asdict

import gymnasium as gym
import numpy as np
import pytest

from textgym.assets.build_arith_proxy import (
    ArithProxyBuild,
    average_ranks,
    correlations,
    roc_auc,
    split_by_problem,
    within_group_auc,
)
from textgym.models import ARITH_EVAL, ARITH_PROXY_RM
from textgym.rewards import Episodes, HFRewardModel, load_norm, make_reward_model


def episodes(prompts, responses):
    return Episodes(prompts=prompts, responses=responses, prompt_ids=[[]] * len(prompts),
                    response_ids=[[]] * len(prompts))  # fmt: skip


def answer(prompt):
    a, b = prompt.rstrip("=").split("+")
    return str(int(a) + int(b))


def play(env, prompt, response):
    """One episode writing ``response`` then EOS; returns the last step's reward and info."""
    base = env.unwrapped
    env.reset(seed=0, options={"prompt": prompt})
    for ch in response:
        env.step(base.tokenizer(ch, add_special_tokens=False)["input_ids"][0])
    _, reward, terminated, _, info = env.step(base.eos_token_id)
    assert terminated
    return reward, info


# ---------------------------------------------------------------- the registered reward model


def test_the_env_pays_the_proxy_and_reports_the_verifier_as_gold():
    env = gym.make("TextArithmetic-v0", reward_model="arithmetic-proxy")
    proxy = HFRewardModel(ARITH_PROXY_RM)
    assert env.unwrapped.reward_model.source == str(ARITH_PROXY_RM)
    for response, gold in (("5", 1.0), ("6", 0.0)):
        reward, info = play(env, "2+3=", response)
        assert info["gold_score"] == gold
        assert info["rm_score"] == pytest.approx(proxy.score(episodes(["2+3="], [response]))[0], abs=1e-5)
        # raw: TextArithmetic-v0 keeps normalize_reward=False unless asked
        assert reward == pytest.approx(env.unwrapped.kl_coef * info["ref_logprob"] + info["rm_score"])
    env.close()


def test_normalize_reward_uses_the_mean_and_std_stored_under_pi_ref():
    stored = load_norm(ARITH_PROXY_RM)
    assert stored is not None and stored.max_new_tokens == 4 and stored.std > 0
    env = gym.make("TextArithmetic-v0", reward_model="arithmetic-proxy", normalize_reward=True)
    reward, info = play(env, "37+48=", "85")
    expected = env.unwrapped.kl_coef * info["ref_logprob"] + (info["rm_score"] - stored.mean) / stored.std
    assert reward == pytest.approx(expected)
    env.close()


def test_a_missing_proxy_folder_says_how_to_build_it(monkeypatch, tmp_path):
    from textgym.rewards import verifiers

    monkeypatch.setattr(verifiers, "ARITH_PROXY_RM", tmp_path / "arith_proxy_rm")
    with pytest.raises(FileNotFoundError, match="arithmetic-proxy.*python -m textgym.assets.build_arith_proxy"):
        make_reward_model("arithmetic-proxy")


# ---------------------------------------------------------------- what it knows, on problems it never saw


@pytest.fixture(scope="module")
def eval_samples():
    """512 π_ref episodes on eval-split problems, scored by the proxy (rm_score) and the verifier (gold_score)."""
    from textgym.rewards.calibrate import sample_episodes

    return sample_episodes(512, 64, seed=0, env_id="TextArithmetic-v0", prompts=str(ARITH_EVAL),
                           reward_model="arithmetic-proxy")  # fmt: skip


def test_the_proxy_ranks_pi_refs_right_answers_above_its_wrong_ones(eval_samples):
    scores = np.array([row["rm_score"] for row in eval_samples])
    labels = np.array([row["gold_score"] for row in eval_samples])
    assert 0.2 < labels.mean() < 0.8
    assert roc_auc(scores, labels) > 0.57  # measured 0.63 (held-out problems of the build: 0.62)


def test_the_proxy_prefers_the_right_answer_to_a_wrong_one_but_not_always(eval_samples):
    wrong = {}
    for row in eval_samples:
        if row["gold_score"] == 0:
            wrong.setdefault(row["prompt"], row["rm_score"])
    problems = list(wrong)[:40]
    assert len(problems) == 40
    right_scores = make_reward_model("arithmetic-proxy").score(episodes(problems, [answer(p) for p in problems]))
    wrong_scores = np.array([wrong[p] for p in problems])
    auc = roc_auc(np.r_[right_scores, wrong_scores], np.r_[np.ones(40), np.zeros(40)])
    # Measured 0.59: within a problem the proxy is weak (build_report.json: within_problem_auc), by design.
    assert auc > 0.52
    assert (wrong_scores > right_scores).any()  # a learned proxy, not the verifier: it prefers some wrong answers


def test_the_build_report_documents_an_informative_imperfect_proxy():
    report = json.loads((ARITH_PROXY_RM / "build_report.json").read_text())
    held = report["heldout"]
    assert report["samples"] == report["train_samples"] + report["heldout_samples"] == 8192
    assert 0.3 < report["right_share"] < 0.7 and report["heldout_problems"] > 0
    assert 0.55 < held["roc_auc"] < 0.95 and held["point_biserial"] > 0.1 and held["spearman"] > 0.1
    assert report["parameters"] < 100_000
    assert report["config"] == asdict(ArithProxyBuild())  # the shipped folder is what the defaults build


# ---------------------------------------------------------------- pure helpers


def test_roc_auc_counts_ties_as_half():
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    # positives {1, 2} vs negatives {1, 0}: 0.5 + 1 + 1 + 1 of 4 pairs
    assert roc_auc([1.0, 1.0, 2.0, 0.0], [1, 0, 1, 0]) == pytest.approx(0.875)
    assert roc_auc([3.0, 2.0, 1.0], [0, 1, 1]) == 0.0
    with pytest.raises(ValueError, match="labels hold 2 positives and 0 negatives"):
        roc_auc([1.0, 2.0], [1, 1])
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        roc_auc([1.0, 2.0], [0, 2])


def test_within_group_auc_compares_answers_to_the_same_problem_only():
    scores, labels, groups = [2.0, 1.0, 0.0, 3.0], [1, 0, 1, 0], ["a", "a", "b", "b"]
    assert roc_auc(scores, labels) == pytest.approx(0.25)  # pooled: 2 > 1 only, of four pairs
    assert within_group_auc(scores, labels, groups) == pytest.approx(0.5)  # a: right wins, b: wrong wins
    assert np.isnan(within_group_auc([1.0, 2.0], [1, 0], ["a", "b"]))  # no problem holds both


def test_ranks_and_correlations():
    np.testing.assert_array_equal(average_ranks([3.0, 1.0, 3.0, 2.0]), [3.5, 1.0, 3.5, 2.0])
    scores, labels = np.array([0.0, 1.0, 2.0, 5.0]), np.array([0, 0, 1, 1])
    got = correlations(scores, labels)
    assert got["point_biserial"] == pytest.approx(np.corrcoef(scores, labels)[0, 1])
    assert correlations(np.exp(scores), labels)["spearman"] == pytest.approx(got["spearman"])  # ranks only


def test_split_by_problem_keeps_each_problem_on_one_side():
    rows = [{"prompt": f"{i % 10}+1=", "response": str(i)} for i in range(50)]
    train, held = split_by_problem(rows, 0.2, seed=0)
    assert len(train) + len(held) == 50 and len({r["prompt"] for r in held}) == 2
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert split_by_problem(rows, 0.2, seed=0) == (train, held)


def test_the_build_config_rejects_bad_values():
    with pytest.raises(ValueError, match=r"heldout_fraction=1\.0 must be in \(0, 1\)"):
        ArithProxyBuild(heldout_fraction=1.0)
    with pytest.raises(ValueError, match="episodes=0 must be an int >= 1"):
        ArithProxyBuild(episodes=0)
