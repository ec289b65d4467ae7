"""skyrl-gym environments as partners (``partner="skyrl:<env_id>"``), against the real skyrl-gym package: episodes
through ``TextMultiTurn-v0`` from seeded rows and from given rows, seeds, the checkers and the refusals."""

from __future__ import annotations

import random
import re
import sys

import gymnasium as gym
import numpy as np
import pytest

import textgym  # noqa: F401  (registers the ids)
from tests.long_lm import build_long_lm, play_turns
from textgym.partners import make_partner
from textgym.partners.skyrl import OFFLINE_ENVS, REFUSED, SkyRLPartner, arithmetic_row


def make(partner="skyrl:gsm8k", **kwargs):
    args = {"max_turn_tokens": 10, "max_new_tokens": 60, "kl_coef": 0.1, **kwargs}
    return gym.make("TextMultiTurn-v0", partner=partner, **args)


def solved(opening: str) -> int:
    a, b, c = (int(x) for x in re.match(r"What is (\d+) \+ (\d+) × (\d+)\?", opening).groups())
    return a + b * c


def ends(infos):
    return [i for i in infos[1:] if "turn_reward" in i]


# ---------------------------------------------------------------- episodes through the env


@pytest.mark.parametrize(
    "env_id, right, wrong, rewards",
    [("gsm8k", "#### {}", "#### 1", (1.0, 0.0)), ("aime", "Answer: {}", "Answer: 1", (1.0, -1.0))],
)
def test_a_one_turn_skyrl_env_pays_its_verdict_for_the_seeds_problem_and_ends(env_id, right, wrong, rewards):
    env = make(f"skyrl:{env_id}")
    for answer, reward in zip((right, wrong), rewards):
        turn = lambda q, answer=answer: answer.format(solved(q))  # noqa: E731
        _, infos = play_turns(env, [turn], seed=0, options={"partner_seed": 5})
        last = infos[-1]
        assert last["done"] and int(last["turns"]) == 1 and float(last["turn_reward_sum"]) == reward
        assert float(last["verdict"]) == float(reward == 1.0)  # the task's own verdict: evaluation's win_rate
        assert last["reply"] == "" and infos[0]["prompt"] == arithmetic_row(env_id, 5)["prompt"][0]["content"]


def test_gsm8k_multi_turn_pays_each_turn_asks_again_and_ends_on_the_right_answer(tmp_path):
    env = make("skyrl:gsm8k_multi_turn", model=build_long_lm(tmp_path), max_new_tokens=200)  # replies of 30 tokens
    _, infos = play_turns(env, ["#### 1", "no answer", lambda q: f"#### {solved(q)}", "#### 2"], seed=2)
    turns = ends(infos)
    assert [float(i["turn_reward"]) for i in turns] == [0.2 / 5, 0.0, 1.0]  # format score / max_turns, 0, right
    assert [i["done"] for i in turns] == [False, False, True] and int(turns[-1]["turns"]) == 3
    assert turns[0]["reply"].startswith("Please provide your step-by-step reasoning")
    assert float(turns[-1]["turn_reward_sum"]) == pytest.approx(1.04) and float(turns[-1]["verdict"]) == 1.0


def test_the_same_seed_gives_the_same_episode_and_seeds_choose_the_problem():
    env = make()
    first = play_turns(env, ["#### 7"], seed=9)
    random.seed(3)  # the caller's global draws do not reach the rows
    np.random.seed(3)
    again = play_turns(env, ["#### 7"], seed=9)
    np.testing.assert_array_equal(first[0]["input_ids"], again[0]["input_ids"])
    assert first[1][0]["prompt"] == again[1][0]["prompt"]
    openings = {play_turns(env, [], seed=s)[1][0]["prompt"] for s in range(5)}
    assert len(openings) == 5
    held_out = {arithmetic_row("gsm8k", 2**30 + s)["prompt"][0]["content"] for s in range(5)}
    assert len(held_out) == 5 and not held_out & openings


def test_given_rows_are_played_by_seed_modulo_their_number_and_each_slot_gets_its_own_env():
    rows = [{"prompt": "Two plus two?", "reward_spec": {"ground_truth": "4"}},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Three times three?"}],
             "reward_spec": {"ground_truth": "9"}}]  # fmt: skip
    partner = SkyRLPartner("gsm8k", rows=rows)
    vec = gym.make_vec("TextMultiTurn-v0", num_envs=2, vectorization_mode="vector_entry_point", partner=partner,
                       max_turn_tokens=10, max_new_tokens=60)  # fmt: skip
    _, info = vec.reset(seed=0, options={"partner_seed": [4, 7]})
    assert list(info["prompt"]) == ["Two plus two?", "Be brief.\n\nThree times three?"]
    slots = vec.unwrapped._engine.dialogue.partners
    assert slots[0] is partner and slots[1] is not partner and slots[1].rows == partner.rows
    answer = lambda text: [{"role": "user", "content": ""}, {"role": "assistant", "content": text}]  # noqa: E731
    assert partner.reply(answer("#### 4")) == ("", 1.0, True)  # slot 0 plays row 0 (seed 4), slot 1 row 1 (seed 7)
    assert slots[1].reply(answer("#### 4")) == ("", 0.0, True)


def test_a_retried_reply_returns_the_same_result_without_a_second_step():
    partner = SkyRLPartner("gsm8k_multi_turn")
    opening = partner.reset(seed=0, prompt="")
    conversation = [{"role": "user", "content": opening}, {"role": "assistant", "content": "#### 1"}]
    first = partner.reply(conversation)
    assert partner.reply(list(conversation)) == first and partner._env.turns == 1
    done = SkyRLPartner("gsm8k")
    done.reset(seed=0, prompt="")
    done.reply(conversation)
    with pytest.raises(RuntimeError, match=r"the skyrl-gym env 'gsm8k' is over \(or was never started\)"):
        done.reply([*conversation, {"role": "user", "content": ""}, {"role": "assistant", "content": "again"}])


def test_the_env_with_a_skyrl_partner_passes_gymnasium_sb3_and_torchrl_checkers():
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env
    from torchrl.envs import GymWrapper
    from torchrl.envs.utils import check_env_specs

    check_env(make("skyrl:gsm8k_multi_turn").unwrapped, skip_render_check=True)
    sb3_check_env(make("skyrl:gsm8k_multi_turn").unwrapped, warn=True)
    check_env_specs(GymWrapper(make("skyrl:aime")), seed=0)
    vec = gym.make_vec("TextMultiTurn-v0", num_envs=2, vectorization_mode="vector_entry_point",
                       autoreset_mode="disabled", partner="skyrl:gsm8k", max_turn_tokens=3)  # fmt: skip
    check_env_specs(GymWrapper(vec), seed=0)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            "skyrl:gsm9k",
            r"skyrl-gym has no env 'gsm9k'; did you mean gsm8k.*\? the envs that run offline are: aime, "
            r"gsm8k, gsm8k_multi_turn$",
        ),
        ("skyrl:", r"skyrl-gym has no env ''; the envs that run offline are: aime, gsm8k, gsm8k_multi_turn$"),
        ("skyrl:text2sql", r"skyrl-gym env 'text2sql' needs the SQLite databases of Spider, BIRD or SynSQL-2.5M"),
        ("skyrl:search", r"skyrl-gym env 'search' needs a Search-R1 retrieval server over HTTP"),
        (
            "skyrl:searchcode",
            r"skyrl-gym env 'searchcode' needs a Search-R1 retrieval server over HTTP, and it runs the policy's "
            r"code",
        ),
        ("skyrl:lcb", r"skyrl-gym env 'lcb' needs LiveCodeBench's test cases .*runs skyrl-gym envs offline; the envs"),
    ],
)
def test_unknown_refused_and_malformed_ids_are_one_error_naming_the_argument_and_what_is_allowed(spec, match):
    with pytest.raises(ValueError, match=rf"^partner='{re.escape(spec)}': " + match):
        gym.make("TextMultiTurn-v0", partner=spec)


@pytest.mark.parametrize(
    "rows, error, match",
    [
        ("rows.jsonl", TypeError, r"rows='rows.jsonl' must be a list of skyrl dataset rows"),
        ([], ValueError, r"rows=\[\]: give at least one row, or rows=None for the seeded arithmetic rows"),
        ([{"question": "2+2"}], ValueError, r"rows\[0\]=\{'question': '2\+2'\} must be a dict with a 'prompt'"),
        (
            [{"prompt": "2+2?"}],
            ValueError,
            r"rows\[0\]: skyrl-gym env 'gsm8k' cannot be built from it "
            r"\(AssertionError: reward_spec field is required\)",
        ),
        (
            [{"prompt": [{"role": "assistant", "content": "x"}], "reward_spec": {"ground_truth": "1"}}],
            ValueError,
            r"rows\[0\]\['prompt'\]=.* must be a str or a non-empty list of \{'role': 'system' \| 'user'",
        ),
    ],
)
def test_bad_rows_are_refused_at_construction_naming_the_row(rows, error, match):
    with pytest.raises(error, match=match):
        SkyRLPartner("gsm8k", rows=rows)


def test_every_registered_id_is_offline_or_refused_and_a_capitalised_prefix_is_refused():
    import skyrl_gym

    assert not set(REFUSED) & OFFLINE_ENVS and set(REFUSED) | OFFLINE_ENVS == set(skyrl_gym.registry)
    with pytest.raises(ValueError, match=r"skyrl-gym environments are named with a lower-case prefix, 'skyrl:gsm8k'"):
        make_partner("SkyRL:gsm8k")


def test_without_skyrl_gym_the_error_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # import skyrl_gym now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'textgym\[skyrl\]'"):
        SkyRLPartner("gsm8k")
    with pytest.raises(ValueError, match=r"^partner='skyrl:gsm8k': .*pip install 'textgym\[skyrl\]'"):
        make_partner("skyrl:gsm8k")
