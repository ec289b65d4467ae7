"""Which integer a chat model's free-text answer commits to: hand-written responses, right and gamed."""

import numpy as np
import pytest

from textgym.rewards import AdditionAnswerVerifier, Episodes, make_reward_model
from textgym.rewards.answers import committed_answer, integers

OPERANDS = (37, 48)


@pytest.mark.parametrize("response", [
    "85",
    " 85.",
    "37 + 48 = 85",
    "The sum of 37 and 48 is 85.",
    "The answer is 85",
    "Answer: **85**",
    "answer = 85\n",
    "7 + 8 = 15, carry the 1; 3 + 4 + 1 = 8.\nAnswer: 85",
    "So the result is $\\boxed{85}$.",
    "Answer: 85\nI hope this helps! The answer is 85.",
    "85.0",
    "37+48=85",
])  # fmt: skip
def test_a_response_that_commits_to_the_sum_is_read_as_it(response):
    assert committed_answer(response, OPERANDS) == 85


@pytest.mark.parametrize("response", [
    "84, 85, 86",                       # a list
    "It is 85 or 86.",                  # a hedge
    "Answer: 85, 86",                   # a list after the statement
    "Answer: 85\nAnswer: 86",           # two statements that disagree
    "The answer is 84. Answer: 85",     # likewise
    "7 + 8 = 15, so it is 85",          # working without a stated answer: two numbers
    "85.5",                             # not an integer
    "I don't know.",                    # no number
    "37 + 48",                          # only the operands
])  # fmt: skip
def test_a_response_that_lists_hedges_or_states_nothing_commits_to_nothing(response):
    assert committed_answer(response, OPERANDS) is None


@pytest.mark.parametrize("response", [
    "The answer is not 85.",              # a denial states no answer
    "It isn't 84; 85",                    # a denial in the working
    "The answer is 84.\nActually 85.",    # a later correction
    "Answer: 85. Wait, that is wrong.",   # a correction without a number
    "85 or eighty-six",                   # number words are numbers
    "The answer is 85 or eighty six.",    # likewise after a statement
    "eighty-five, or 86",                 # likewise
])  # fmt: skip
def test_a_denial_a_correction_or_an_alternative_in_words_commits_to_nothing(response):
    """Issue 37.8: these were paid (rule 2 saw one digit number; a statement ignored what came after it)."""
    assert committed_answer(response, OPERANDS) is None


@pytest.mark.parametrize(("response", "expected"), [
    ("thirty-seven plus forty-eight is eighty-five", 85),
    ("The answer is eighty five.", 85),
    ("One hundred and twelve", 112),
    ("This one is easy: 85", 85),          # "one" after a determiner is a pronoun
    ("The answer is 85. 37 + 48 = 85, as 7 + 8 = 15.", None),   # 7, 8, 15 after the statement: not one answer
    ("The answer is 85.\nCheck: 37 + 48 = 85.", 85),            # only operands and the answer after it
])  # fmt: skip
def test_number_words_are_read_as_numbers(response, expected):
    assert committed_answer(response, OPERANDS) == expected


def test_numbers_are_read_with_signs_commas_and_fractions():
    assert integers("1,234 and -5, then 2.50 and 3.0; x2 is no number") == [1234, -5, None, 3]
    assert committed_answer("Answer: 1,234", (600, 634)) == 1234
    assert committed_answer("Answer: −12", ()) == -12


def _episodes(prompts, responses):
    return Episodes(prompts=prompts, responses=responses, prompt_ids=[[]] * len(prompts),
                    response_ids=[[]] * len(prompts))  # fmt: skip


def test_the_addition_verifier_pays_one_for_a_committed_right_sum_and_is_registered():
    v = make_reward_model("addition-answer")
    assert isinstance(v, AdditionAnswerVerifier)
    prompts = ["What is 37 + 48?"] * 4 + ["Add 12+30."]
    got = v.score(_episodes(prompts, ["The answer is 85.", "84, 85, 86", "86", "Answer: 85, 86", "42"]))
    np.testing.assert_array_equal(got, [1.0, 0.0, 0.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="prompt='Write a review' asks for no sum of the form 'a \\+ b'"):
        v.score(_episodes(["Write a review"], ["85"]))


def test_the_shipped_addition_sets_are_what_the_module_writes_and_hold_out_whole_pairs():
    from textgym.assets import PROMPT_SETS
    from textgym.assets.addition_requests import request_lines, split
    from textgym.envs import load_prompts

    for name in split():
        assert PROMPT_SETS[name].read_text(encoding="utf-8").splitlines() == request_lines(name)
    train, held_out = load_prompts("addition-requests"), load_prompts("addition-requests-eval")
    pairs = {name: {tuple(sorted(AdditionAnswerVerifier.operands(p))) for p in prompts}
             for name, prompts in (("train", train), ("eval", held_out))}  # fmt: skip
    assert len(train) + len(held_out) == 81 and len(pairs["eval"]) == 12  # every ordered a + b of 1-9 once
    assert not pairs["train"] & pairs["eval"]  # no pair, in either order, is asked in training
    assert all(min(AdditionAnswerVerifier.operands(p)) >= 1 for p in train + held_out)  # no operand is the answer


def test_the_addition_verifier_pays_nothing_for_a_denial_a_correction_or_an_alternative_in_words():
    """Issue 37.8: the three responses the issue found paid 1.0 for "What is 3 + 4?"."""
    responses = ["The answer is not 7.", "The answer is 7.\nActually 8.", "7 or eight", "The answer is 7."]
    got = AdditionAnswerVerifier().score(_episodes(["What is 3 + 4?"] * 4, responses))
    np.testing.assert_array_equal(got, [0.0, 0.0, 0.0, 1.0])
