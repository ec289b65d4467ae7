"""The env-side findings of the fault trial (issue 27): each a clear error at the call that causes it."""

import re

import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from textgym.models import DEFAULT_LM
from textgym.rewards import Episodes, RewardModelError, score_checked


class _Returns:
    name = "fixed"
    shares_tokenizer = False

    def __init__(self, value):
        self.value = value

    def score(self, episodes: Episodes):
        return self.value


EPISODES = Episodes(["a", "b"], ["x", "y"], [[1], [1]], [[2], [2]])


@pytest.mark.parametrize("value", [[True, False], np.array([True, True]), torch.tensor([True, False])])
def test_reward_model_outputs_of_type_bool_are_refused(value):
    with pytest.raises(RewardModelError, match=r"reward model 'fixed' returned .*bool.*not one float per episode"):
        score_checked(_Returns(value), EPISODES)


@pytest.mark.parametrize("value", [[1e308, 0.0], [0.0, -1e39], np.array([0.0, 3.5e38])])
def test_reward_model_outputs_beyond_float32_are_refused(value):
    with pytest.raises(RewardModelError, match=r"reward model 'fixed' returned .* for episode \d.*not finite in "
                                                r"float32"):  # fmt: skip
        score_checked(_Returns(value), EPISODES)


def test_float32_extremes_are_accepted():
    big = float(np.finfo(np.float32).max)
    assert score_checked(_Returns([big, -big]), EPISODES).tolist() == [big, -big]


@pytest.mark.parametrize("options", [[1], "prompt", 3])
def test_reset_options_that_are_not_a_dict_are_refused(single, vec, options):
    for env in (single, vec):
        with pytest.raises(TypeError, match=re.escape(f"options={options!r} must be a dict or None")):
            env.reset(options=options)


OPTION_VALUES = st.one_of(st.none(), st.text(max_size=6), st.integers(), st.booleans(),
                          st.lists(st.text(max_size=3), max_size=3))  # fmt: skip
OPTION_DICTS = st.dictionaries(st.sampled_from(["prompt", "reset_mask", "other"]), OPTION_VALUES, max_size=2)
OPTIONS = st.one_of(st.none(), st.lists(st.integers(), max_size=2), st.text(max_size=4), st.integers(), OPTION_DICTS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=OPTIONS)
def test_any_reset_options_give_an_episode_or_one_clear_error(single, vec, options):
    """The env API under arbitrary options: never an AttributeError or IndexError from inside the env."""
    for env in (single, vec):
        try:
            obs, _ = env.reset(options=options)
        except (TypeError, ValueError) as err:
            assert "options" in str(err) or "prompt" in str(err), err
        else:
            assert env.observation_space.contains(obs)


JSONL = '{"prompt": "Great movie"}\n{"prompt": "Bad movie"}\n'


@pytest.mark.parametrize("suffix, text", [(".txt", "Great movie\nBad movie\n"), (".jsonl", JSONL)])
def test_a_utf8_bom_is_not_part_of_the_first_prompt(tmp_path, suffix, text):
    from textgym.envs import load_prompts

    path = tmp_path / f"p{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_prompts(str(path)) == ["Great movie", "Bad movie"]


def test_a_prompt_longer_than_the_models_positions_says_how_long_prompts_may_be():
    from transformers import AutoConfig

    positions = AutoConfig.from_pretrained(DEFAULT_LM).max_position_embeddings
    pattern = rf"prompts\[1\]=.* is \d+ tokens; model has {positions} positions, so with max_new_tokens=3 a prompt"
    with pytest.raises(ValueError, match=rf"{pattern} may be at most {positions - 3} tokens"):
        gym.make("TextRLHF-v0", prompts=["short", "word " * (2 * positions)], max_new_tokens=3)


def test_a_model_whose_vocabulary_is_smaller_than_its_tokenizers_is_refused_at_make(tmp_path):
    from textgym.models import load_causal_lm, load_tokenizer

    model, tok = load_causal_lm(DEFAULT_LM), load_tokenizer(DEFAULT_LM)
    model.resize_token_embeddings(len(tok) - 5)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=rf"model=.*m' has {len(tok) - 5} output tokens but its tokenizer has "
                                         rf"{len(tok)}"):  # fmt: skip
        gym.make("TextRLHF-v0", model=str(tmp_path / "m"), max_new_tokens=3)
