"""Partners of the multi-turn envs: ``partner=`` resolution, the checked calls, TextArena games, the calculator."""

from __future__ import annotations

import random
import re
import sys
import threading
import time
import urllib.error

import numpy as np
import pytest

from textgym.partners import (
    Calculator,
    FunctionPartner,
    PartnerError,
    TextArenaPartner,
    available_partners,
    make_partner,
    reply_checked,
    reset_checked,
)
from textgym.timeouts import CallAbandoned, call_within

CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


class Echo:
    """A partner with state: it counts its replies."""

    def __init__(self):
        self.calls = 0

    def reply(self, conversation):
        self.calls += 1
        return f"echo {conversation[-1]['content']}", 0.5, False


def echo(conversation):
    return conversation[-1]["content"].upper(), 1.0, True


# ---------------------------------------------------------------- make_partner: the routes


def test_a_class_gives_each_slot_a_new_instance_and_the_first_is_built_at_once():
    built = []

    class Counting(Echo):
        def __init__(self):
            super().__init__()
            built.append(self)

    factory = make_partner(Counting)
    assert len(built) == 1  # validated eagerly, before any slot asks
    a, b = factory(), factory()
    assert a is built[0] and b is built[1] and a is not b


def test_a_function_is_one_stateless_partner_every_slot_shares():
    factory = make_partner(echo)
    a, b = factory(), factory()
    assert isinstance(a, FunctionPartner) and a is b
    assert a.reply(CONVERSATION) == ("HELLO", 1.0, True) and a.name == "echo"


def test_an_object_serves_the_first_slot_and_deep_copies_of_its_state_at_make_time_the_others():
    obj = Echo()
    obj.calls = 7
    factory = make_partner(obj)
    first = factory()
    first.reply(CONVERSATION)  # slot 0 is mid-episode when slot 1 asks
    second = factory()
    assert first is obj and second is not obj
    assert (first.calls, second.calls) == (8, 7)
    second.calls = 100
    assert obj.calls == 8


def test_an_object_that_cannot_be_copied_serves_one_slot_and_a_second_slot_says_to_pass_its_class():
    class Locked(Echo):
        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()

    factory = make_partner(Locked())
    factory()
    with pytest.raises(TypeError, match=r"partner=<.*Locked.*cannot be deep-copied.*pass its class instead"):
        factory()


def test_a_module_attr_string_imports_the_module(tmp_path, monkeypatch):
    (tmp_path / "tg_partner_mod.py").write_text(
        "class Game:\n    def reply(self, conversation):\n        return 'moved', 0.0, False\n"
        "def judge(conversation):\n    return '', 2.0, True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    game = make_partner("tg_partner_mod:Game")()
    assert type(game).__name__ == "Game" and game.reply(CONVERSATION) == ("moved", 0.0, False)
    assert make_partner("tg_partner_mod:judge")().reply(CONVERSATION) == ("", 2.0, True)
    with pytest.raises(ValueError, match=r"partner='tg_partner_mod:nope': module 'tg_partner_mod' has no attribute"):
        make_partner("tg_partner_mod:nope")


def test_an_installed_entry_point_is_found_by_name(tmp_path, monkeypatch):
    (tmp_path / "tg_partner_plugin.py").write_text(
        "class Referee:\n    def reply(self, conversation):\n        return 'fine', 0.25, False\n"
    )
    info = tmp_path / "tg_partner_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tg-partner-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[textgym.partners]\nreferee = tg_partner_plugin:Referee\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "referee" in available_partners() and "calculator" in available_partners()
    partner = make_partner("referee")()
    assert type(partner).__name__ == "Referee" and partner.reply(CONVERSATION) == ("fine", 0.25, False)


def test_the_builtin_calculator_by_name():
    factory = make_partner("calculator")
    assert isinstance(factory(), Calculator) and factory() is not factory()


@pytest.mark.parametrize(
    "spec, error, match",
    [
        (42, TypeError, r"partner=42 \(int\) is not a partner; expected a partner class, an object with a reply"),
        (
            "nope",
            ValueError,
            r"partner='nope' is not a registered partner \(calculator, guess-the-number-10\), an adapter's "
            r"'<prefix><id>' \(textarena:, gem:, skyrl:, openenv:\)",
        ),
        ("nomodule_xyz:attr", ValueError, r"partner='nomodule_xyz:attr': module 'nomodule_xyz' cannot be imported"),
        (int, TypeError, r"partner=<class 'int'> built int, which has no reply\(\) method"),
    ],
)
def test_a_bad_spec_raises_one_error_naming_the_argument_and_the_value(spec, error, match):
    with pytest.raises(error, match=match):
        make_partner(spec)


def test_the_argument_name_is_the_callers():
    with pytest.raises(ValueError, match=r"^opponent='nope' is not a registered partner"):
        make_partner("nope", name="opponent")


class Broken:
    def __init__(self):
        raise RuntimeError("no game server")

    def reply(self, conversation):
        return "", 0.0, True


def test_a_class_that_fails_to_build_fails_at_make_time_naming_the_argument():
    with pytest.raises(
        PartnerError, match=r"partner=<class '.*Broken'>: building the partner raised RuntimeError: no game"
    ):
        make_partner(Broken)


# ---------------------------------------------------------------- reply_checked / reset_checked


def partner_returning(value):
    class Returning:
        def reply(self, conversation):
            return value

    return Returning()


@pytest.mark.parametrize(
    "value, match",
    [
        ((42, 1.0, False), r"\(42, 1.0, False\): text is int, not str"),
        (("ok", True, False), r"reward is bool, not a real number"),
        (("ok", np.bool_(True), False), r"reward is bool_?, not a real number"),
        (("ok", float("nan"), False), r"reward nan is not finite"),
        (("ok", float("inf"), False), r"reward inf is not finite"),
        (("ok", 1e39, False), r"reward 1e\+39 is not finite in float32"),
        (("ok", 10**400, False), r"is not finite in float32"),
        (("ok", "1.0", False), r"reward is str, not a real number"),
        (("ok", None, False), r"reward is NoneType, not a real number"),
        (("ok", 1.0), r"expected a tuple of 3, got of length 2"),
        (("ok", 1.0, False, {}), r"expected a tuple of 3, got of length 4"),
        ("ok", r"expected a tuple of 3, got a str"),
        (("ok", 1.0, 0), r"done is int, not bool"),
        (("ok", 1.0, None), r"done is NoneType, not bool"),
    ],
)
def test_a_malformed_reply_is_one_partner_error_naming_the_partner_the_slot_and_what_is_allowed(value, match):
    with pytest.raises(PartnerError, match=r"partner 'Returning' \(env slot 3\)\.reply returned .*" + match) as info:
        reply_checked(partner_returning(value), CONVERSATION, timeout=None, slot=3)
    assert "must return (text: str, reward: finite real number, not bool, done: bool)" in str(info.value)


def test_a_good_reply_comes_back_as_str_float_bool_also_from_numpy_values():
    text, reward, done = reply_checked(partner_returning(["ok", np.float32(0.5), np.bool_(True)]), CONVERSATION, 1.0)
    assert (text, reward, done) == ("ok", 0.5, True)
    assert type(reward) is float and type(done) is bool
    assert reply_checked(partner_returning(("", np.int64(-2), False)), CONVERSATION, None) == ("", -2.0, False)


def test_a_raising_partner_is_one_partner_error_naming_it_the_slot_and_the_cause():
    def crashes(conversation):
        raise KeyError("board")

    with pytest.raises(PartnerError, match=r"partner 'test_a_raising.*crashes' \(env slot 0\)\.reply raised KeyError"):
        reply_checked(FunctionPartner(crashes), CONVERSATION, timeout=1.0, slot=0)


def test_a_hanging_partner_is_abandoned_after_the_timeout():
    release = threading.Event()

    class Hangs:
        def reply(self, conversation):
            release.wait(30)
            return "late", 0.0, False

    start = time.perf_counter()
    try:
        hang = r"did not return within partner_timeout=0.2 s; the call was abandoned and the step undone"
        with pytest.raises(PartnerError, match=r"partner 'Hangs' \(env slot 5\)\.reply " + hang):
            reply_checked(Hangs(), CONVERSATION, timeout=0.2, slot=5)
        assert time.perf_counter() - start < 5
    finally:
        release.set()  # let the abandoned thread finish


def test_a_partners_own_timeout_error_is_a_failure_it_raised_not_a_hang():
    def times_out(conversation):
        raise TimeoutError("upstream game server")

    with pytest.raises(PartnerError, match=r"reply raised TimeoutError: upstream game server"):
        reply_checked(FunctionPartner(times_out), CONVERSATION, timeout=5.0)


def test_reset_checked_calls_reset_when_there_is_one_and_checks_its_result():
    assert reset_checked(Echo(), seed=0, prompt="p", timeout=None) is None  # no reset: keep the env's prompt

    class Opening(Echo):
        def reset(self, *, seed, prompt):
            return None if seed == 0 else (f"{prompt} #{seed}" if seed == 1 else seed)

    assert reset_checked(Opening(), seed=0, prompt="p", timeout=1.0) is None
    assert reset_checked(Opening(), seed=1, prompt="p", timeout=1.0) == "p #1"
    with pytest.raises(
        PartnerError, match=r"partner 'Opening' \(env slot 2\)\.reset returned int 7; .* \(str\) or None"
    ):
        reset_checked(Opening(), seed=7, prompt="p", timeout=1.0, slot=2)


def test_call_within_returns_reraises_and_abandons():
    assert call_within(lambda: 3, 1.0, "t") == 3
    with pytest.raises(ZeroDivisionError):
        call_within(lambda: 1 / 0, 1.0, "t")
    with pytest.raises(CallAbandoned):
        call_within(lambda: time.sleep(2), 0.05, "t")


# ---------------------------------------------------------------- the calculator


def calc(text):
    return Calculator().reply([{"role": "user", "content": "q"}, {"role": "assistant", "content": text}])


def test_the_calculator_evaluates_the_last_call_of_the_turn():
    assert calc("so <calc>2+3*4</calc> it is") == ("<result>14</result>", 0.0, False)
    assert calc("<calc>1+1</calc> no wait <calc>(2 + 3) * -4 // 3 % 5</calc>") == ("<result>3</result>", 0.0, False)
    assert calc("<calc>7/2</calc>")[0] == "<result>3.5</result>"
    assert calc("<calc>2**-2 + 0.5</calc>")[0] == "<result>0.75</result>"
    assert calc("<calc>2**300 // 2**290</calc>")[0] == "<result>1024</result>"


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("9**9**9", "result too large"),
        ("10**100", "result too large"),
        ("10**60 * 10**60", "result too large"),
        ("(-8) ** 0.5", "complex result"),
        ("2.0 ** 5000", "result too large"),
        ("abs(3)", "not a call"),
        ("x + 1", r"not a name \(x\)"),
        ("(1).real", "not an attribute"),
        ("__import__('os').system('true')", "not a call"),
        ("True + 1", "not the constant True"),
        ("1 << 3", "not the operator LShift"),
        ("'a' * 3", "not the constant 'a'"),
        ("2 +", "not an arithmetic expression"),
        ("1+" * 300 + "1", "expression longer than 500 characters"),
    ],
)
def test_the_calculator_refuses_what_is_not_plain_bounded_arithmetic(expression, reason):
    start = time.perf_counter()
    text, reward, done = calc(f"<calc>{expression}</calc>")
    assert time.perf_counter() - start < 1  # refused, not computed
    assert text.startswith("<result>error: ") and (reward, done) == (0.0, False)
    assert re.search(reason, text), text


def test_a_turn_without_a_call_is_the_final_answer():
    assert calc("The answer is 14.") == ("", 0.0, True)
    assert calc("<calc>1+1") == ("", 0.0, True)  # an unclosed call is no call


# ---------------------------------------------------------------- TextArena


def turn(conversation, text):
    return [*conversation, {"role": "assistant", "content": text}]


def play(partner, seed, guesses):
    """The opening and the replies to ``guesses`` (each guess a new turn of one conversation)."""
    conversation = [{"role": "user", "content": partner.reset(seed=seed, prompt="ignored")}]
    replies = []
    for guess in guesses:
        conversation = turn(conversation, guess)
        replies.append(partner.reply(conversation))
        if replies[-1][2]:
            break
        conversation.append({"role": "user", "content": replies[-1][0]})
    return conversation[0]["content"], replies


def test_textarena_by_name_is_validated_at_make_time_and_gives_each_slot_its_own_game():
    pytest.importorskip("textarena")
    factory = make_partner("textarena:GuessTheNumber-v0")
    a, b = factory(), factory()
    assert isinstance(a, TextArenaPartner) and a is not b and a._env is not b._env
    assert a.name == "textarena:GuessTheNumber-v0"


@pytest.mark.parametrize(
    "game, match",
    [
        ("NoSuchGame-v0", r"TextArena has no game 'NoSuchGame-v0'; the single-player games are: 2048-v0, "),
        ("GuessTheNumbr-v0", r"TextArena has no game 'GuessTheNumbr-v0'; did you mean GuessTheNumber-v0"),
        (
            "TicTacToe-v0",
            r"TextArena game 'TicTacToe-v0' is a multi-player game; only single-player games are supported",
        ),
        (
            "Hangman-v0",
            r"TextArena game 'Hangman-v0' needs the nltk 'words' corpus, which it downloads .* runs games offline",
        ),
        ("TwentyQuestions-v0", r"TextArena game 'TwentyQuestions-v0' needs an LLM game master over the network"),
    ],
)
def test_textarena_refuses_unknown_multi_player_and_download_games_naming_them(game, match):
    pytest.importorskip("textarena")
    with pytest.raises(ValueError, match=rf"^partner='textarena:{game}': " + match):
        make_partner(f"textarena:{game}")


def test_without_textarena_the_error_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # import textarena now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'textgym\[textarena\]'"):
        TextArenaPartner("GuessTheNumber-v0")
    with pytest.raises(ValueError, match=r"^partner='textarena:GuessTheNumber-v0': .*pip install 'textgym\[textarena"):
        make_partner("textarena:GuessTheNumber-v0")


def test_guess_the_number_hints_the_way_and_a_correct_guess_wins_reward_one():
    pytest.importorskip("textarena")
    game = TextArenaPartner("GuessTheNumber-v0")
    opening = game.reset(seed=0, prompt="ignored")
    assert opening.startswith("[GAME] You are Player 0. You are playing Guess The Number.")
    conversation, low, high = [{"role": "user", "content": opening}], 1, 20
    for _ in range(10):  # binary search on the hints: at most 5 guesses for 1..20
        guess = (low + high) // 2
        conversation = turn(conversation, f"I guess [{guess}]")
        text, reward, done = game.reply(conversation)
        if done:
            break
        assert reward == 0.0 and text in ("[GAME] The target number is higher.", "[GAME] The target number is lower.")
        low, high = (guess + 1, high) if "higher" in text else (low, guess - 1)
        conversation.append({"role": "user", "content": text})
    assert (reward, done) == (1.0, True) and guess == game._env.game_number
    assert text == "[GAME] Congratulations! You guessed the correct number."
    assert game.verdict()  # the game's own outcome, which evaluation's win_rate counts (issue 44.4)
    with pytest.raises(RuntimeError, match="is over"):
        game.reply(turn(conversation, "[1]"))
    game.reset(seed=0, prompt="")
    assert not game.verdict()  # a new game is not won yet


def test_guess_the_number_same_seed_same_game_whatever_else_draws_from_random():
    pytest.importorskip("textarena")
    guesses = ["[10]", "[5]", "[12]", "[3]"]  # none is seed 11's number (15) or seed 12's (16): four turns each
    first = play(TextArenaPartner("GuessTheNumber-v0"), 11, guesses)
    # a second game, played interleaved with a third and with the caller drawing from `random` in between
    b, other = TextArenaPartner("GuessTheNumber-v0"), TextArenaPartner("GuessTheNumber-v0")
    conversation = [{"role": "user", "content": b.reset(seed=11, prompt="")}]
    other.reset(seed=12, prompt="")
    random.seed(5)
    outside = random.getstate()
    replies = []
    for guess in guesses:
        conversation = turn(conversation, guess)
        replies.append(b.reply(conversation))
        other.reply([{"role": "user", "content": ""}, {"role": "assistant", "content": guess + str(len(replies))}])
        conversation.append({"role": "user", "content": replies[-1][0]})
    assert random.getstate() == outside  # the games' seeding and draws stay out of the caller's `random`
    assert (conversation[0]["content"], replies) == first
    hints = {tuple(play(TextArenaPartner("GuessTheNumber-v0"), seed, guesses)[1]) for seed in range(6)}
    assert len(hints) > 1  # the seed does choose the number


def test_a_retried_reply_returns_the_same_result_without_spending_a_turn():
    pytest.importorskip("textarena")
    game = TextArenaPartner("GuessTheNumber-v0")
    conversation = turn([{"role": "user", "content": game.reset(seed=0, prompt="")}], "[10]")
    first = game.reply(conversation)
    turns = game._env.state.turn
    assert game.reply(list(conversation)) == first and game._env.state.turn == turns == 1
    again = [*conversation, {"role": "user", "content": first[0]}, {"role": "assistant", "content": "[10]"}]
    assert "already guessed" in game.reply(again)[0]  # a new turn with the same text is a move


class NeedsData:
    """A game whose reset fails the way a missing nltk corpus or a failed download does."""

    error: Exception = LookupError("Resource words not found.\nPlease use the NLTK Downloader")

    def __init__(self, **kwargs):
        pass

    def reset(self, num_players, seed=None):
        raise NeedsData.error


@pytest.mark.parametrize(
    "error",
    [LookupError("Resource words not found.\nPlease use the NLTK Downloader"), ConnectionError("unreachable"),
     urllib.error.URLError("Name or service not known")],
)  # fmt: skip
def test_a_game_that_cannot_find_or_fetch_its_data_at_reset_is_refused_naming_it(monkeypatch, error):
    pytest.importorskip("textarena")
    from textarena.envs.registration import ENV_REGISTRY, EnvSpec

    monkeypatch.setitem(ENV_REGISTRY, "TgNeedsData-v0", EnvSpec("TgNeedsData-v0", NeedsData, None))
    monkeypatch.setattr(NeedsData, "error", error)
    game = make_partner("textarena:TgNeedsData-v0")()  # registered outside textarena's folders: not in the tables
    with pytest.raises(ValueError, match=r"^TextArena game 'TgNeedsData-v0' needs data it could not find or fetch"):
        game.reset(seed=0, prompt="")
    with pytest.raises(PartnerError, match=r"\(env slot 1\)\.reset raised ValueError: TextArena game 'TgNeedsData"):
        reset_checked(game, 0, "", timeout=5.0, slot=1)


def test_guess_the_number_10_pays_wins_and_valid_guesses_not_a_near_miss():
    """The built-in task: 0.1 per valid new guess, 1 more for the win, 0 for an invalid answer or a lost game."""
    pytest.importorskip("textarena")
    from textgym.partners import GuessTheNumber10, make_partner

    game = make_partner("guess-the-number-10")()
    assert isinstance(game, GuessTheNumber10)
    opening = game.reset(seed=3, prompt="")
    assert "between 1 and 10 within 4 turns" in opening
    target = game._env.game_number
    wrong = [g for g in range(1, 11) if g != target]
    conversation = [{"role": "user", "content": opening}]
    rewards = []
    for answer in (f"[{wrong[0]}]", "no idea", f"[{wrong[1]}]", f"[{target}]"):
        conversation = turn(conversation, answer)
        text, reward, done = game.reply(conversation)
        rewards.append(reward)
        conversation = [*conversation, {"role": "user", "content": text}]
    assert rewards == [0.1, 0.0, 0.1, 1.1] and done
    game.reset(seed=3, prompt="")  # valid misses to the end (TextArena's turn check lets a fifth guess through):
    conversation = [{"role": "user", "content": opening}]  # the game's own near-miss credit is not paid
    for g in wrong[:5]:
        conversation = turn(conversation, f"[{g}]")
        text, reward, done = game.reply(conversation)
        conversation = [*conversation, {"role": "user", "content": text}]
    assert (reward, done) == (0.1, True)
    game.reset(seed=3, prompt="")  # two invalid answers in a row end the game with nothing
    conversation = turn(turn([{"role": "user", "content": opening}], "x"), "y")
    assert game.reply(conversation[:2])[1] == 0.0 and game.reply(conversation)[1:] == (0.0, True)
