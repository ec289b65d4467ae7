"""reasoning-gym as a single-turn task, with the real package: ``prompts="reasoning-gym:<dataset>[:eval]"`` and
``reward_model="reasoning-gym:<dataset>"`` — the same questions in any process, disjoint splits, full credit as the
verdict through the env and the evaluator, the checkers, and one clear error for each wrong name."""

import json
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

import textgym  # noqa: F401  (registers the envs)
from textgym.envs.prompts import load_prompts
from textgym.reasoning_gym_task import EVAL_SIZE, TRAIN_SIZE
from textgym.rewards import Episodes, RewardModelError, make_reward_model
from textgym.rewards.reasoning_gym_verifier import ReasoningGymVerifier

# two-term sums of numbers up to two digits: short questions ("Calculate 31 + 59."), short answers
SPEC = "reasoning-gym:basic_arithmetic?max_terms=2&max_digits=2&operators=+"
EVAL = "reasoning-gym:basic_arithmetic:eval?max_terms=2&max_digits=2&operators=+"


def episodes(prompts, responses):
    return Episodes(prompts=prompts, responses=responses, prompt_ids=[[]] * len(prompts),
                    response_ids=[[]] * len(prompts))  # fmt: skip


@pytest.fixture(scope="module")
def env():
    env = gym.make("TextRLHF-v0", prompts=SPEC, reward_model=SPEC, normalize_reward=False, max_new_tokens=6)
    yield env
    env.close()


# ---------------------------------------------------------------- the prompts: seeded splits


def test_a_spec_gives_the_same_questions_in_another_process():
    here = load_prompts(SPEC) + load_prompts(EVAL)
    code = (f"import json; from textgym.envs.prompts import load_prompts; "
            f"print(json.dumps(load_prompts({SPEC!r}) + load_prompts({EVAL!r})))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == here
    assert here[0].startswith("Calculate ") and here[0].endswith(".")


@pytest.mark.parametrize("digits", [1, 2])
def test_train_and_eval_are_disjoint_and_eval_keeps_what_train_does_not_hold(digits):
    """With one-digit terms few distinct sums exist: most of the eval draws are train questions, and are removed."""
    spec = f"reasoning-gym:basic_arithmetic?max_terms=2&max_digits={digits}&operators=+"
    train, held_out = load_prompts(spec), load_prompts(spec.replace("basic_arithmetic", "basic_arithmetic:eval"))
    assert not set(train) & set(held_out)
    assert len(set(train)) == len(train) <= TRAIN_SIZE and len(set(held_out)) == len(held_out) < EVAL_SIZE
    assert len(held_out) >= 100  # 110 of 500 remain for one digit, 351 for two


def test_options_change_the_questions_and_their_order_does_not():
    swapped = "reasoning-gym:basic_arithmetic?operators=+&max_digits=2&max_terms=2"
    assert load_prompts(swapped) == load_prompts(SPEC) != load_prompts("reasoning-gym:basic_arithmetic")
    sums = load_prompts("reasoning-gym:basic_arithmetic?operators=+")
    assert not any(op in p for p in sums for op in (" * ", " / ")) and all(" + " in p for p in sums)


# ---------------------------------------------------------------- the verifier


def test_the_verifier_pays_full_credit_for_the_answer_and_its_verdict_is_full_credit():
    verifier = make_reward_model(SPEC)
    assert isinstance(verifier, ReasoningGymVerifier) and verifier.name.startswith("reasoning-gym:basic_arithmetic")
    train, held_out = load_prompts(SPEC), load_prompts(EVAL)
    right = [verifier.entry(p)["answer"] for p in (train[0], held_out[0])]  # it knows both splits
    batch = episodes([train[0], held_out[0], train[0], train[0]], [f" {right[0]} ", right[1], "x" + right[0], "7x"])
    np.testing.assert_allclose(verifier.score(batch)[[0, 1, 3]], [1.0, 1.0, 0.0])
    assert 0 < verifier.score(batch)[2] < 1  # reasoning-gym's partial credit ...
    assert verifier.verdicts(batch).tolist() == [True, True, False, False]  # ... is not a solve


def test_an_episode_forced_to_write_the_answer_gets_reward_one_and_verdict_one(env):
    base = env.unwrapped
    question = load_prompts(SPEC)[0]
    for answer, score in ((base.reward_model.entry(question)["answer"], 1.0), ("0", 0.0)):
        env.reset(seed=0, options={"prompt": question})
        ids = base.tokenizer(answer, add_special_tokens=False)["input_ids"] + [base.eos_token_id]
        for token in ids:
            _, reward, terminated, _, info = env.step(token)
        assert terminated and info["response"] == answer
        assert info["rm_score"] == score and info["verdict"] == score
        assert reward == pytest.approx(base.kl_coef * info["ref_logprob"] + score)  # raw: normalize_reward=False


def test_the_env_passes_gymnasium_sb3_and_torchrl_checkers(env):
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env
    from torchrl.envs import GymWrapper
    from torchrl.envs.utils import check_env_specs

    check_env(env.unwrapped, skip_render_check=True)
    sb3_check_env(env.unwrapped, warn=True)
    check_env_specs(GymWrapper(env), seed=0)
    vec = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point", autoreset_mode="disabled",
                       prompts=SPEC, reward_model=SPEC, normalize_reward=False, max_new_tokens=6)  # fmt: skip
    check_env_specs(GymWrapper(vec), seed=0)
    vec.close()


def test_evaluate_reports_the_verdicts_win_rate_on_the_held_out_split():
    from textgym.agents.evaluate import evaluate

    result = evaluate(None, env_id="TextRLHF-v0", prompts=EVAL, reward_model=SPEC, normalize_reward=False,
                      max_new_tokens=4, episodes=8, num_envs=8)  # fmt: skip
    assert result["judged_episodes"] == 8 and 0.0 <= result["win_rate"] <= 1.0
    assert result["samples"][0]["prompt"] == load_prompts(EVAL)[0]


def test_a_saved_policys_run_info_may_name_a_reasoning_gym_verifier_but_not_a_module(tmp_path):
    """A run trained on the names is evaluated from its folder alone; a ``module:attr`` there is still refused."""
    from textgym.agents.evaluate import RUN_INFO, run_settings

    (tmp_path / RUN_INFO).write_text(json.dumps({"env_id": "TextRLHF-v0", "reward_model": SPEC, "eval_prompts": EVAL}))
    assert run_settings(str(tmp_path)) == {"env_id": "TextRLHF-v0", "reward_model": SPEC, "eval_prompts": EVAL}
    (tmp_path / RUN_INFO).write_text(json.dumps({"env_id": "TextRLHF-v0", "reward_model": "mymodule:score"}))
    with pytest.raises(ValueError, match=r"reward_model='mymodule:score', a 'module:attr' that would be imported"):
        run_settings(str(tmp_path))


# ---------------------------------------------------------------- one clear error per wrong name


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("reasoning-gym:basic_arithmetc", r"no dataset 'basic_arithmetc'; did you mean basic_arithmetic"),
        ("reasoning-gym:basic_arithmetic:test", r"split 'test' is not one of 'train' \(the default\) or 'eval'"),
        ("reasoning-gym:basic_arithmetic?max_digit=2", r"'max_digit' is no option .*did you mean 'max_digits'"),
        ("reasoning-gym:basic_arithmetic?max_digits=two", r"option max_digits='two' must be an int"),
        ("reasoning-gym:basic_arithmetic?seed=3", r"'seed' is no option .*seed and size are the split's"),
        ("reasoning-gym:basic_arithmetic?max_digits=0", r"reasoning-gym refuses basic_arithmetic with max_digits=0"),
    ],
)
def test_a_bad_spec_is_one_error_naming_the_argument_the_value_and_what_is_allowed(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        load_prompts(spec)
    assert str(err.value).startswith(f"prompts={spec!r}: ")
    with pytest.raises(ValueError, match=message) as err:
        make_reward_model(spec, "gold_scorer")
    assert str(err.value).startswith(f"gold_scorer={spec!r}: ")


def test_a_prompt_that_is_no_question_of_the_dataset_is_named():
    verifier = make_reward_model(SPEC)
    with pytest.raises(ValueError, match=r"prompt='Calculate 1 \+ 1 \+ 1\.' is no question of its train split"):
        verifier.score(episodes(["Calculate 1 + 1 + 1."], ["3"]))


def test_the_env_refuses_prompts_its_verifier_does_not_know_when_it_scores_them():
    env = gym.make("TextRLHF-v0", prompts=["The movie was"], reward_model=SPEC, normalize_reward=False,
                   max_new_tokens=1, gold_scorer=None)  # fmt: skip
    env.reset(seed=0)
    with pytest.raises(RewardModelError, match=r"prompt='The movie was' is no question"):
        env.step(env.unwrapped.eos_token_id)


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what `import reasoning_gym` sees when not installed
    with pytest.raises(ImportError, match=r"pip install reasoning-gym"):
        load_prompts("reasoning-gym:basic_arithmetic")


def test_a_run_on_a_reasoning_gym_dataset_is_evaluated_on_its_held_out_split_unless_told_otherwise():
    """The env's own eval split (review requests) scored by the dataset's verifier would refuse every prompt: a run
    that names reasoning-gym train prompts and no eval prompts records, and evaluates on, the dataset's held-out
    split, with its options."""
    from textgym.agents.ppo import PPOConfig
    from textgym.reasoning_gym_task import held_out_name

    name = "reasoning-gym:basic_arithmetic?max_digits=2&operators=+"
    held_out = "reasoning-gym:basic_arithmetic:eval?max_digits=2&operators=+"
    assert held_out_name(name) == held_out and held_out_name("reasoning-gym:basic_arithmetic:train") == (
        "reasoning-gym:basic_arithmetic:eval"
    )
    assert held_out_name(held_out) is None and held_out_name("review-requests") is None and held_out_name(None) is None
    cfg = PPOConfig(prompts=name, reward_model=name, normalize_reward=False)
    assert cfg.held_out_prompts() == held_out and cfg.run_info()["eval_prompts"] == held_out
    given = PPOConfig(prompts=name, reward_model=name, eval_prompts="my-eval.txt")
    assert given.held_out_prompts() == "my-eval.txt" and given.run_info()["eval_prompts"] == "my-eval.txt"
    assert PPOConfig().run_info().get("eval_prompts") is None  # the env's own eval split, as before
