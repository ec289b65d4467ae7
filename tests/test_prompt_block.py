"""A conversation's prompt block: sized so that other seeds' openings fit, and a clear error when one does not."""

import sys
import textwrap

import gymnasium as gym
import pytest

from textgym.agents.ppo import PPOConfig, Trainer
from textgym.agents.ppo.config import PRESETS
from textgym.envs.encoding import opening_margin
from textgym.envs.turns import _PROBED_OPENINGS


class Board:
    """A game whose rules grow with the seed past the probed ones (issue 42's repro)."""

    def reset(self, *, seed, prompt):
        return "rules " + "x " * (3 if seed < 4 else 3 + seed % 7)

    def reply(self, conversation):
        return "ok", 0.0, False


def test_openings_of_seeds_beyond_the_probed_ones_fit():
    env = gym.make("TextMultiTurn-v0", partner=Board, max_new_tokens=16, max_turn_tokens=3)
    for seed in range(200):
        obs, _ = env.reset(seed=seed)
    assert env.unwrapped.max_prompt_tokens >= 16  # the margin: at least 16 columns past the longest probed opening


def test_an_opening_that_does_not_fit_names_its_seed_and_the_width_that_fits():
    class Long(Board):
        def reset(self, *, seed, prompt):
            return "rules " + "x " * (3 if seed < 100 else 40)

    env = gym.make("TextMultiTurn-v0", partner=Long, max_new_tokens=16)
    width = env.unwrapped.max_prompt_tokens
    with pytest.raises(ValueError, match=rf"^the partner's opening for seed 123='rules x x .* is (\d+) tokens, more "
                       rf"than max_prompt_tokens={width}; .* build the env with max_prompt_tokens >= \1 "
                       r"\(textgym train --max-prompt-tokens\)"):  # fmt: skip
        env.reset(seed=0, options={"partner_seed": 123})
    env.reset(seed=0, options={"partner_seed": 5})  # the refused reset changed nothing: the env goes on
    wide = gym.make("TextMultiTurn-v0", partner=Long, max_new_tokens=16, max_prompt_tokens=100)
    wide.reset(seed=0, options={"partner_seed": 123})


def test_textgym_train_takes_max_prompt_tokens_and_trains_on_a_growing_opening(tmp_path, monkeypatch):
    (tmp_path / "board_partner.py").write_text(textwrap.dedent('''
        class Board:
            def reset(self, *, seed, prompt):
                return "rules " + "x " * (3 if seed < 4 else 3 + seed % 7)

            def reply(self, conversation):
                return "ok", 0.0, False
    '''))  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("board_partner", None)
    base = {**PRESETS["tiny"], "env_id": "TextMultiTurn-v0", "partner": "board_partner:Board", "max_new_tokens": 16,
            "max_turn_tokens": 3, "total_episodes": 16, "out": str(tmp_path / "run")}  # fmt: skip
    trainer = Trainer.create(PPOConfig(**base))  # the repro: iteration 1 drew seeds past 3 and crashed
    trainer.iteration()
    assert PPOConfig(**base, max_prompt_tokens=64).env_kwargs()["max_prompt_tokens"] == 64
    with pytest.raises(ValueError, match=r"max_prompt_tokens=0 must be an int >= 1 or None"):
        PPOConfig(**base, max_prompt_tokens=0)


def _one_id_per_game() -> list[str]:
    from textgym.partners.textarena import single_player_ids

    ids: dict[str, str] = {}
    for gid in single_player_ids():
        ids.setdefault(gid.split("-")[0], gid)  # the first registered id of each game (GuessTheNumber-v0 ...)
    return sorted(ids.values())


# Seeds per game: 200, except the games whose reset builds a puzzle by trial (RushHour 0.47 s a seed,
# Sokoban 0.09 s): their openings had one length over seeds 0-199 (133 and 255 tokens, docs/multi-turn.md).
SLOW_RESETS = {"RushHour-v0": 20, "Sokoban-v0": 50}


def test_every_offline_game_fits_its_block_over_200_seeds_with_smollm2s_chat_template():
    """The block the env sizes (seeds 0-3's longest opening + the margin) holds every opening of 200 seeds."""
    pytest.importorskip("textarena")
    from textgym.models import load_tokenizer
    from textgym.partners.base import make_partner

    tok = load_tokenizer("smollm2-135m-instruct")

    def tokens(text: str) -> int:
        chat = [{"role": "user", "content": text}]
        return len(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))

    games = _one_id_per_game()
    assert len(games) == 22
    for gid in games:
        partner = make_partner(f"textarena:{gid}")()
        lengths = [tokens(partner.reset(seed=seed, prompt="")) for seed in range(SLOW_RESETS.get(gid, 200))]
        probed = max(lengths[:_PROBED_OPENINGS])
        assert max(lengths) <= probed + opening_margin(probed), gid


def test_a_game_whose_rules_do_not_fit_the_embedded_lm_names_a_model_that_fits():
    """Issue 42.8: the natural first try failed naming no fix; the partner=None error suggested that same call."""
    pytest.importorskip("textarena")
    with pytest.raises(ValueError, match=r"the partner's opening for seed 0=.* is 18\d tokens \(with room for other "
                       r"seeds' openings, a block of \d+\); model has 128 positions, .* a model with more positions "
                       r"fits it, e.g. model='smollm2-135m-instruct' \(8192\) with chat_template=True"):  # fmt: skip
        gym.make("TextMultiTurn-v0", partner="textarena:GuessTheNumber-v0")
    with pytest.raises(TypeError, match=r"partner='textarena:GuessTheNumber-v0', model='smollm2-135m-instruct', "
                                        r"chat_template=True"):  # fmt: skip
        gym.make("TextMultiTurn-v0")
