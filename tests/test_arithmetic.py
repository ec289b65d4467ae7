"""TextArithmetic-v0: a verifiable reward, disjoint splits, a π_ref with room to improve, and GRPO learns it."""

import json

import gymnasium as gym
import numpy as np
import pytest

from textgym.models import ARITH_EVAL, ARITH_LM, ARITH_TRAIN
from textgym.rewards import ArithmeticVerifier, Episodes


def episodes(prompts, responses):
    return Episodes(prompts=prompts, responses=responses, prompt_ids=[[]] * len(prompts),
                    response_ids=[[]] * len(prompts))  # fmt: skip


def test_the_verifier_checks_the_exact_sum():
    v = ArithmeticVerifier()
    got = v.score(episodes(["37+48=", "37+48=", "1+1=", "9+9="], ["85", " 85 ", "3", "18x"]))
    np.testing.assert_array_equal(got, [1.0, 1.0, 0.0, 0.0])
    shaped = ArithmeticVerifier(format_reward=0.1).score(episodes(["1+1=", "1+1=", "1+1="], ["2", "3", "two"]))
    np.testing.assert_allclose(shaped, [1.1, 0.1, 0.0])
    with pytest.raises(ValueError, match="prompt='The movie' is not an arithmetic problem"):
        v.score(episodes(["The movie"], ["85"]))


def test_the_env_pays_one_for_the_right_answer():
    env = gym.make("TextArithmetic-v0")
    base = env.unwrapped
    env.reset(seed=0, options={"prompt": "2+3="})
    tok = base.tokenizer
    five = tok("5", add_special_tokens=False)["input_ids"][0]
    _, r1, term, _, info1 = env.step(five)
    assert not term and r1 == pytest.approx(base.kl_coef * info1["ref_logprob"])
    _, r2, term, _, info = env.step(base.eos_token_id)
    assert term and info["response"] == "5" and info["rm_score"] == 1.0 and info["gold_score"] == 1.0
    assert r2 == pytest.approx(base.kl_coef * info["ref_logprob"] + 1.0)  # raw: normalize_reward=False


def test_splits_are_disjoint_and_pi_ref_has_room_to_improve():
    train, evals = ARITH_TRAIN.read_text().split(), ARITH_EVAL.read_text().split()
    assert len(train) == 4000 and len(evals) == 2000 and not set(train) & set(evals)
    report = json.loads((ARITH_LM / "build_report.json").read_text())
    assert 0.2 <= report["eval_accuracy_t1_all"] <= 0.6
    assert report["sft_problems"] == 4000 and not report["history"][-1]["eval_accuracy_t1"] > 0.6


@pytest.mark.slow
def test_grpo_raises_exact_answer_accuracy_on_held_out_problems(tmp_path):
    import torch

    from textgym.agents.evaluate import evaluate
    from textgym.agents.ppo import PPOConfig, Trainer
    from textgym.policies import LMSampler

    # The learning rate decays linearly to 0: at a constant 1e-4 the held-out accuracy of the last policy swung
    # with where training stopped (seeds 0-4: +1.7 to +10.8 points; seed 0's training accuracy had passed +10
    # and fallen back). Decayed, seeds 0-3 gained +7.2 to +8.7 points (docs/performance.md, the sampler's lever row).
    cfg = PPOConfig(env_id="TextArithmetic-v0", algo="grpo", group_size=8, num_envs=64, max_new_tokens=4,
                    target_kl=None, learning_rate=1e-4, lr_schedule="linear", ppo_epochs=2, num_minibatches=2,
                    device="cpu", total_episodes=64 * 200, out=str(tmp_path), progress=False)  # fmt: skip
    trainer = Trainer.create(cfg)
    for _ in range(200):
        trainer.iteration()

    def accuracy(model):
        factory = lambda envs: LMSampler.for_env(model or envs.unwrapped.model, envs,  # noqa: E731
                                                 generator=torch.Generator().manual_seed(0))  # fmt: skip
        return evaluate(policy_factory=factory, episodes=600, num_envs=100, env_id="TextArithmetic-v0")["gold_score"][0]

    before, after = accuracy(None), accuracy(trainer.policy)
    assert after > before + 0.05, (before, after)
