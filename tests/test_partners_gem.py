"""GEM environments as partners (``partner="gem:<env_id>"``), against the real gem-llm package: episodes through
``TextMultiTurn-v0``, seeds, the checkers, the refusals, and reasoning-gym 0.1.25 under gem's 0.1.23 pin."""

from __future__ import annotations

import inspect
import json
import os
import random
import re
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

import textgym  # noqa: F401  (registers the ids)
from tests.long_lm import build_long_lm, play_turns
from textgym.partners import PartnerError, make_partner
from textgym.partners.gem import REFUSED, GEMPartner, offline_ids

GAME = "game:GuessTheNumber-v0-easy"  # 1..10 in 4 guesses; its rules are about 200 tokens of the embedded tokenizer


@pytest.fixture(scope="module")
def long_lm(tmp_path_factory):
    return build_long_lm(tmp_path_factory.mktemp("long_lm"))


def make(long_lm, partner=f"gem:{GAME}", **kwargs):
    args = {"model": long_lm, "max_turn_tokens": 12, "max_new_tokens": 160, "kl_coef": 0.1, **kwargs}
    return gym.make("TextMultiTurn-v0", partner=partner, **args)


def direct(env_id, seed, turns):
    """The opening and replies of GEM's own env played without textgym: ``gem.make``, ``reset(seed)``, ``step``."""
    import gem

    state = random.getstate(), np.random.get_state()
    try:
        env = gem.make(env_id)
        obs, info = env.reset(seed=seed)
        out = [(obs, info.get("suffix"))]
        for text in turns:
            obs, reward, terminated, truncated, info = env.step(text)
            out.append((obs, reward, terminated or truncated))
            if terminated or truncated:
                break
        return out
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


# ---------------------------------------------------------------- episodes through the env


def test_a_gem_game_through_the_env_pays_gems_rewards_per_turn_and_its_end_ends_the_episode(long_lm):
    env = make(long_lm)
    guesses = ["\\boxed{5}", "\\boxed{3}", "\\boxed{8}", "\\boxed{1}", "\\boxed{9}"]
    obs, infos = play_turns(env, guesses, seed=0, options={"partner_seed": 7})
    ends = [i for i in infos[1:] if "turn_reward" in i]  # each turn's last step
    own = direct(GAME, 7, guesses)  # GEM alone: the same game, the same turns
    assert infos[0]["prompt"] == f"{own[0][0]}{own[0][1]}"  # the rules, then GEM's suffix
    assert len(ends) == len(own) - 1 >= 2 and ends[-1]["done"] and not any(i["done"] for i in infos[1:-1])
    assert [float(i["turn_reward"]) for i in ends] == [float(r) for _, r, _ in own[1:]]
    assert [i["reply"] for i in ends] == [f"{text}\nEnter your next guess." for text, _, _ in own[1:]]
    assert float(ends[-1]["turn_reward_sum"]) == pytest.approx(sum(r for _, r, _ in own[1:]))
    assert int(ends[-1]["turns"]) == len(ends)
    sent = [m["content"] for m in ends[-1]["conversation"] if m["role"] == "assistant"]
    assert sent == guesses[: len(ends)]


def test_a_turn_without_a_boxed_guess_ends_the_game_with_gems_format_penalty(long_lm):
    env = make(long_lm)
    _, infos = play_turns(env, ["five"], seed=3)
    last = infos[-1]
    assert last["done"] and int(last["turns"]) == 1 and float(last["turn_reward_sum"]) == -0.1
    assert last["reply"] == "At turn 1, you did not provide a valid guess.\nEnter your next guess."


def test_the_same_seed_gives_the_same_episode_and_seeds_choose_the_game(long_lm):
    env, other = make(long_lm), make(long_lm)
    turns = ["\\boxed{4}", "\\boxed{6}", "\\boxed{2}"]
    first = play_turns(env, turns, seed=11)
    random.seed(1)  # the caller's draws between episodes do not reach the game
    np.random.seed(1)
    play_turns(other, turns, seed=12)
    again = play_turns(env, turns, seed=11)
    assert [i.get("reply") for i in first[1]] == [i.get("reply") for i in again[1]]
    np.testing.assert_array_equal(first[0]["input_ids"], again[0]["input_ids"])
    replies = {tuple(i.get("reply") for i in play_turns(env, turns, seed=s)[1]) for s in range(6)}
    assert len(replies) > 1


MOVES = {
    "game:Minesweeper-v0-easy": ["\\boxed{reveal 2 2}", "\\boxed{reveal 0 4}", "\\boxed{reveal 4 0}"],
    "game:Game2048-v0-easy": ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}", "\\boxed{right}"],
    "game:Sokoban-v0-easy": ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}"],
}


@pytest.mark.parametrize("game", sorted(MOVES))
def test_games_that_draw_in_step_replay_the_same_for_the_same_seed_whatever_else_draws(game):
    """Minesweeper lays its mines at the first reveal, 2048 adds a random tile each move: draws inside ``step``."""
    moves = MOVES[game]

    def play(partner, seed, between=lambda: None):
        conversation = [{"role": "user", "content": partner.reset(seed=seed, prompt="")}]
        out = [conversation[0]["content"]]
        for move in moves:
            between()
            out.append(partner.reply([*conversation, {"role": "assistant", "content": move}]))
            conversation += [{"role": "assistant", "content": move}, {"role": "user", "content": out[-1][0]}]
            if out[-1][2]:
                break
        return out

    first = play(GEMPartner(game), 5)
    b, other = GEMPartner(game), GEMPartner(game)
    other.reset(seed=6, prompt="")
    outside = random.getstate()
    calls = []  # another game moving between b's moves (a new conversation each time: no retry)

    def other_moves():
        calls.append(moves[len(calls) % 2])
        if not other._over:
            other.reply([{"role": "user", "content": ""}, *({"role": "assistant", "content": m} for m in calls)])

    interleaved = play(b, 5, between=other_moves)
    assert interleaved == first and random.getstate() == outside
    assert len(first) > 2 and not any(reply[1] < 0 for reply in first[1:])  # moves GEM read, not format errors
    assert len({str(play(GEMPartner(game), s)) for s in range(4)}) > 1


# Seed 21's opening of each game named on the command line and the reply to one move, with the count of root log
# handlers after: run here and in another process.
PLAY_SCRIPT = """
import json, logging, sys
from textgym.partners.gem import GEMPartner

def opening_and_reply(game):
    partner = GEMPartner(game)
    opening = partner.reset(seed=21, prompt="")
    move = [{"role": "user", "content": opening}, {"role": "assistant", "content": "\\\\boxed{reveal 1 1}"}]
    return [opening, list(partner.reply(move))]

if __name__ == "__main__":
    print(json.dumps([[opening_and_reply(g) for g in sys.argv[1:]], len(logging.getLogger().handlers)]))
"""


def test_a_seed_gives_the_same_games_in_another_process_and_the_import_leaves_its_root_logger_alone():
    """Another process with another hash seed plays the same games. And ``import gem`` calls
    ``logging.basicConfig(level=INFO)`` (a root handler in the user's process): the partner's import takes it out."""
    import gem

    assert "logging.basicConfig(" in inspect.getsource(gem)
    games = ["game:Minesweeper-v0-easy", "game:Mastermind-v0-easy", "rg:basic_arithmetic"]
    env = {**os.environ, "PYTHONHASHSEED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", PLAY_SCRIPT, *games], capture_output=True, text=True, env=env,
                          timeout=120, check=True)  # fmt: skip
    there, handlers = json.loads(proc.stdout.strip().splitlines()[-1])
    assert handlers == 0
    here: dict = {}
    exec(PLAY_SCRIPT, here)  # defines opening_and_reply (not run as __main__)
    assert there == [here["opening_and_reply"](g) for g in games]
    assert there[0][1][0].startswith("At turn 1, you successfully revealed cell (1, 1).")


def test_the_env_with_a_gem_partner_passes_gymnasium_sb3_and_torchrl_checkers(long_lm):
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env
    from torchrl.envs import GymWrapper
    from torchrl.envs.utils import check_env_specs

    check_env(make(long_lm).unwrapped, skip_render_check=True)
    sb3_check_env(make(long_lm).unwrapped, warn=True)
    check_env_specs(GymWrapper(make(long_lm)), seed=0)
    vec = gym.make_vec("TextMultiTurn-v0", num_envs=2, vectorization_mode="vector_entry_point",
                       autoreset_mode="disabled", partner=f"gem:{GAME}", model=long_lm, max_turn_tokens=4,
                       max_new_tokens=80)  # fmt: skip
    check_env_specs(GymWrapper(vec), seed=0)


# ---------------------------------------------------------------- reasoning-gym through GEM (the pin)


def test_gems_reasoning_gym_envs_run_on_reasoning_gym_0_1_25_as_one_turn_tasks(long_lm):
    """gem-llm pins reasoning-gym 0.1.23; textgym installs it beside 0.1.25: what GEM uses of it works there."""
    from importlib.metadata import version

    assert version("reasoning-gym") == "0.1.25"
    game = GEMPartner("rg:basic_arithmetic")
    question = game.reset(seed=4, prompt="")
    expression = re.fullmatch(r"Calculate (.+)\.", question).group(1)
    answer = int(eval(expression))  # the dataset's own expression; its divisions are exact
    opening = [{"role": "user", "content": question}]
    assert not game.verdict()  # nothing answered yet
    assert game.reply([*opening, {"role": "assistant", "content": f"so \\boxed{{{answer}}}"}]) == ("", 1.0, True)
    assert game.verdict()
    game.reset(seed=4, prompt="")
    assert game.reply([*opening, {"role": "assistant", "content": f"\\boxed{{{answer + 1}}}"}]) == ("", 0.0, True)
    assert not game.verdict()
    env = make(long_lm, partner="gem:rg:basic_arithmetic", max_new_tokens=40)
    _, infos = play_turns(env, [f"\\boxed{{{answer}}}"], seed=0, options={"partner_seed": 4})
    assert infos[0]["prompt"] == question and infos[-1]["done"] and float(infos[-1]["turn_reward_sum"]) == 1.0


def test_an_answer_whose_reasoning_gym_scorer_raises_scores_zero_and_a_readable_one_keeps_its_score():
    """reasoning-gym 0.1.25's boxnet scorer raises TypeError on ``\\boxed{1}``, an answer it cannot read."""
    task = GEMPartner("rg:boxnet")
    question = task.reset(seed=0, prompt="")
    with pytest.raises(TypeError):  # what GEM alone does with that answer
        task._env.step("\\boxed{1}")
    answer = lambda text: [{"role": "user", "content": question}, {"role": "assistant", "content": text}]  # noqa: E731
    assert task.reply(answer("\\boxed{1}")) == ("", 0.0, True)
    task.reset(seed=0, prompt="")
    assert task.reply(answer("\\boxed{[]}")) == ("", 0.05, True)  # boxnet's own score for an empty plan


def test_a_seed_picks_the_same_reasoning_gym_problem_after_many_episodes():
    """GEM swaps in a new problem set every 500 seeded resets; the partner keeps one, so seed 3 stays seed 3's."""
    game = GEMPartner("rg:basic_arithmetic")
    first = game.reset(seed=3, prompt="")
    for seed in range(600):
        game.reset(seed=seed, prompt="")
    assert game.reset(seed=3, prompt="") == first


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            "gem:game:GuessTheNumbr-v0-easy",
            r"GEM has no env 'game:GuessTheNumbr-v0-easy'; did you mean "
            r"game:GuessTheNumber-v0-easy",
        ),
        ("gem:", r"GEM has no env ''; the offline games are: game:Crosswords-v0-easy, .*; and rg:<dataset>"),
        (
            "gem:game:Wordle-v0-easy",
            r"GEM env 'game:Wordle-v0-easy' needs the nltk 'words' corpus, which it "
            r"downloads .*runs GEM envs offline; the offline games are: ",
        ),
        ("gem:math:GSM8K", r"GEM env 'math:GSM8K' needs the Hugging Face dataset 'axon-rl/GSM-8k', which it downloads"),
        (
            "gem:code:Taco8k",
            r"GEM env 'code:Taco8k' needs the Hugging Face dataset 'axon-rl/TACO-8k', .* runs the "
            r"policy's code",
        ),
        (
            "gem:game:FifteenPuzzle-v0-random",
            r"GEM env 'game:FifteenPuzzle-v0-random' needs a fix in GEM: its "
            r"constructor fails in gem-llm 0.1.0",
        ),
    ],
)
def test_unknown_refused_and_malformed_ids_are_one_error_naming_the_argument_and_what_is_allowed(spec, match):
    with pytest.raises(ValueError, match=rf"^partner='{re.escape(spec)}': " + match):
        gym.make("TextMultiTurn-v0", partner=spec)


def test_a_capitalised_prefix_and_a_seed_numpy_cannot_take_are_refused_naming_them(long_lm):
    with pytest.raises(ValueError, match=r"GEM environments are named with a lower-case prefix, 'gem:game:Guess"):
        make_partner("GEM:game:GuessTheNumber-v0-easy")
    env = make(long_lm)
    with pytest.raises(PartnerError, match=r"reset raised ValueError: seed=8589934592: GEM seeds NumPy's global RNG, "
                                           r"which takes seeds in \[0, 2\*\*32\)"):  # fmt: skip
        env.reset(options={"partner_seed": 2**33})


def test_every_refused_key_names_registered_ids_and_no_offline_id_is_refused():
    from gem.envs.registration import ENV_REGISTRY

    for key in REFUSED:
        assert any(gid == key or gid.startswith(key) for gid in ENV_REGISTRY), key
    ids = offline_ids()
    assert len([g for g in ids if g.startswith("game:")]) == 26 and len([g for g in ids if g.startswith("rg:")]) > 90
    assert not {"game:Wordle-v0-easy", "game:Crosswords-v0-random", "math:GSM8K"} & set(ids)


def test_without_gem_the_error_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gem", None)  # import gem now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'textgym\[gem\]'"):
        GEMPartner(GAME)
    with pytest.raises(ValueError, match=rf"^partner='gem:{GAME}': .*pip install 'textgym\[gem\]'"):
        make_partner(f"gem:{GAME}")
