"""Issue 43.2: the env settings are one dataclass (``textgym.envs.settings.EnvSettings``) that the agents' config
is built on; the trainer, eval, bench and run info take them from it, so a new env argument reaches them all.
``partner_timeout`` reached none of the five lists before: ``textgym train`` could not bound a hanging partner."""

import argparse
import dataclasses
import sys
import textwrap
import time

import pytest

from textgym.agents.evaluate import ENV_SETTINGS
from textgym.agents.ppo import PPOConfig, Trainer
from textgym.agents.ppo.config import FIELD_GROUPS, PRESETS, add_config_args, config_from_args
from textgym.envs.settings import ENV_FIELDS, EnvSettings
from textgym.partners import PartnerError


def test_every_env_setting_is_a_config_field_a_flag_and_an_eval_setting():
    config_fields = {f.name for f in dataclasses.fields(PPOConfig)}
    assert set(ENV_FIELDS) <= config_fields and FIELD_GROUPS["env (the task)"] == ENV_FIELDS
    assert set(ENV_FIELDS) <= set(ENV_SETTINGS)
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args(["--config", "tiny", "--partner-timeout", "2.5", "--max-prompt-tokens", "40"])
    cfg = config_from_args(args)
    expected = {**dataclasses.asdict(EnvSettings()), "max_new_tokens": PRESETS["tiny"]["max_new_tokens"],
                "partner_timeout": 2.5, "max_prompt_tokens": 40}  # fmt: skip
    assert cfg.partner_timeout == 2.5 and cfg.env_settings() == EnvSettings(**expected)
    assert cfg.env_kwargs()["partner_timeout"] == 2.5 and cfg.env_kwargs()["kl_coef"] == cfg.kl_coef


def test_env_settings_refuse_bad_numbers_before_a_model_loads():
    with pytest.raises(ValueError, match=r"^partner_timeout=-1.0 must be a finite float > 0 \(seconds\) or None$"):
        PPOConfig(partner_timeout=-1.0)
    with pytest.raises(ValueError, match=r"^max_new_tokens=0 must be an int >= 1$"):
        PPOConfig(max_new_tokens=0)


def test_the_run_info_keeps_the_env_settings_but_the_train_prompts_and_the_timeouts():
    cfg = PPOConfig(prompts="review-requests", eval_prompts="review-requests-eval", max_prompt_tokens=40,
                    prompt_column="text", partner_timeout=3.0)  # fmt: skip
    info = cfg.env_settings().run_info()
    assert info["max_prompt_tokens"] == 40 and info["prompt_column"] == "text"
    assert info["eval_prompts"] == "review-requests-eval" and info["env_id"] == "TextRLHF-v0"
    assert not {"prompts", "reward_timeout", "partner_timeout"} & set(info)


def test_a_training_run_stops_on_a_partner_hanging_past_partner_timeout(tmp_path, monkeypatch):
    (tmp_path / "slow_partner.py").write_text(textwrap.dedent('''
        import time

        class Slow:
            def reset(self, *, seed, prompt):
                return None

            def reply(self, conversation):
                time.sleep(60)
                return "late", 0.0, True
    '''))  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("slow_partner", None)
    cfg = PPOConfig(**{**PRESETS["tiny"], "env_id": "TextMultiTurn-v0", "partner": "slow_partner:Slow",
                       "max_new_tokens": 8, "max_turn_tokens": 2, "num_envs": 2, "total_episodes": 2,
                       "num_minibatches": 1, "partner_timeout": 0.5, "out": str(tmp_path / "run")})  # fmt: skip
    trainer = Trainer.create(cfg)
    start = time.perf_counter()
    with pytest.raises(PartnerError, match=r"0\.5"):
        trainer.iteration()
    assert time.perf_counter() - start < 20
