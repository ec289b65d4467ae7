"""Bad input gets one clear error naming the argument, the value and what is allowed — never a silent wrong answer."""

import re
import shutil
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import ResetNeeded

from textgym.envs import TextRLHFEnv
from textgym.models import DEFAULT_LM, DEFAULT_RM
from textgym.rewards import RewardModelError

LONG_PROMPT = "The movie was " * 40


def make_with_rm(fn):
    return gym.make("TextRLHF-v0", reward_model=fn, normalize_reward=False, max_new_tokens=3)


def finish_episode(env):
    """Reset and end at once with EOS: the reward model is called on the first step."""
    env.reset(seed=0)
    return env.step(env.unwrapped.eos_token_id)


# ---------------------------------------------------------------- actions, single env
@pytest.mark.parametrize("bad", [-1, "vocab_size"])
def test_action_outside_the_space(single, bad):
    single.reset(seed=0)
    vocab = single.unwrapped.action_space.n
    action = vocab if bad == "vocab_size" else bad
    with pytest.raises(ValueError, match=rf"action={action} is outside the action space.*\[0, {vocab}\)"):
        single.step(action)


@pytest.mark.parametrize("bad", [1.5, "a", None, True, np.bool_(False), np.float64(3.0), np.array([3])])
def test_action_of_the_wrong_type(single, bad):
    single.reset(seed=0)
    vocab = single.unwrapped.action_space.n
    with pytest.raises(TypeError, match=rf"action=.* must be an integer token id in \[0, {vocab}\)"):
        single.step(bad)


def test_integer_like_actions_are_accepted(single):
    single.reset(seed=0)
    single.step(np.int64(5))
    single.step(np.array(5))


# ---------------------------------------------------------------- actions, vector env
@pytest.mark.parametrize("bad", [np.array([1, 2, 3]), np.array([[1, 2]]), np.array(1), [1]])
def test_vector_actions_of_the_wrong_shape(vec, bad):
    vec.reset(seed=0)
    with pytest.raises(ValueError, match=r"actions=.* must be an integer array of shape \(2,\)"):
        vec.step(bad)


@pytest.mark.parametrize("bad", ["neg", "vocab"])
def test_vector_actions_outside_the_space(vec, bad):
    vec.reset(seed=0)
    vocab = vec.single_action_space.n
    actions = np.array([1, -1 if bad == "neg" else vocab])
    with pytest.raises(ValueError, match=rf"actions\[1\]={actions[1]} is outside the action space.*\[0, {vocab}\)"):
        vec.step(actions)


@pytest.mark.parametrize("bad", [np.array([1.0, 2.0]), np.array([True, False]), np.array(["1", "2"])])
def test_vector_actions_of_the_wrong_dtype(vec, bad):
    vec.reset(seed=0)
    with pytest.raises(ValueError, match=r"actions=.* must be an integer array"):
        vec.step(bad)


def test_vector_step_before_reset():
    envs = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point", max_new_tokens=3)
    with pytest.raises(RuntimeError, match=r"step\(\) called before reset\(\)"):
        envs.step(np.array([1, 2]))


# ---------------------------------------------------------------- episode order
def test_step_before_reset():
    env = gym.make("TextRLHF-v0", max_new_tokens=3)
    with pytest.raises(RuntimeError, match=r"step\(\) called before reset\(\)"):
        env.unwrapped.step(1)
    with pytest.raises(ResetNeeded, match=r"before calling env.reset\(\)"):  # Gymnasium's OrderEnforcing
        env.step(1)


def test_step_after_the_episode_ended(single):
    eos = single.unwrapped.eos_token_id
    single.reset(seed=0)
    _, _, terminated, _, _ = single.step(eos)
    assert terminated
    with pytest.raises(RuntimeError, match=r"step\(\) called after the episode ended"):
        single.unwrapped.step(1)
    with pytest.raises(RuntimeError, match=r"step\(\) called after the episode ended"):  # the wrapped env too
        single.step(1)
    single.reset(seed=0)
    single.step(1)  # a reset makes it usable again


# ---------------------------------------------------------------- prompts
def test_empty_prompt_is_allowed(single):
    obs, info = single.reset(seed=0, options={"prompt": ""})
    assert info["prompt"] == ""
    P = single.unwrapped.max_prompt_tokens
    assert obs["attention_mask"][:P].sum() == 1
    _, reward, _, _, info = single.step(5)
    assert np.isfinite(reward) and np.isfinite(info["ref_logprob"])


def test_too_long_prompt_in_reset_is_refused(single):
    limit = single.unwrapped.max_prompt_tokens
    with pytest.raises(ValueError, match=rf"prompt='The movie was .* more than max_prompt_tokens={limit}"):
        single.reset(options={"prompt": LONG_PROMPT})


def test_too_long_prompt_in_vector_reset_is_refused(vec):
    with pytest.raises(ValueError, match=r"prompt='The movie was .* more than max_prompt_tokens="):
        vec.reset(options={"prompt": ["ok", LONG_PROMPT]})


def test_too_long_prompt_in_the_prompt_list_is_refused():
    with pytest.raises(ValueError, match=r"prompts\[1\]='The movie was .* more than max_prompt_tokens=5"):
        gym.make("TextRLHF-v0", prompts=["short", LONG_PROMPT], max_prompt_tokens=5)


def test_non_str_prompt_is_refused(single):
    with pytest.raises(TypeError, match=r"prompt=3 .*str"):
        single.reset(options={"prompt": 3})
    with pytest.raises(TypeError, match=r"prompts\[1\]=3 .*str"):
        gym.make("TextRLHF-v0", prompts=["ok", 3])


def test_failed_reset_on_a_fresh_env_starts_no_episode():
    env = gym.make("TextRLHF-v0", max_new_tokens=3)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        env.reset(options={"prompt": LONG_PROMPT})
    with pytest.raises(RuntimeError, match=r"step\(\) called before reset\(\)"):
        env.unwrapped.step(1)
    # OrderEnforcing records the reset attempt, but the env itself still refuses
    with pytest.raises(RuntimeError, match=r"step\(\) called before reset\(\)"):
        env.step(1)


def test_failed_reset_mid_episode_leaves_the_episode_untouched():
    """Decision: a refused reset changes nothing; the running episode steps on as if it never happened."""
    clean = gym.make("TextRLHF-v0", max_new_tokens=4)
    hit = gym.make("TextRLHF-v0", max_new_tokens=4)
    for env in (clean, hit):
        env.reset(seed=0, options={"prompt": "The movie was"})
        env.step(7)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        hit.reset(options={"prompt": LONG_PROMPT})
    for a in (9, 11, 13):
        expect, got = clean.step(a), hit.step(a)
        for key in ("input_ids", "attention_mask"):
            np.testing.assert_array_equal(expect[0][key], got[0][key])
        assert got[1:4] == pytest.approx(expect[1:4])
        assert got[4]["ref_logprob"] == pytest.approx(expect[4]["ref_logprob"])
    assert got[2] and got[4]["length_capped"] and got[4]["prompt"] == "The movie was"


def test_failed_vector_reset_leaves_all_slots_untouched():
    envs = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point", max_new_tokens=3)
    obs, _ = envs.reset(seed=0)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        envs.reset(options={"prompt": ["ok", LONG_PROMPT]})
    after = envs.unwrapped._engine.observation(slice(None))
    for key in obs:
        np.testing.assert_array_equal(obs[key], after[key])
    envs.step(np.array([1, 2]))


# ---------------------------------------------------------------- paths
@pytest.mark.parametrize("path", ["/nonexistent/dir", "./nope"])
def test_model_path_that_does_not_exist(path):
    with pytest.raises(FileNotFoundError, match=rf"model={re.escape(repr(path))} does not exist"):
        gym.make("TextRLHF-v0", model=path)


def test_tokenizer_path_that_does_not_exist():
    with pytest.raises(FileNotFoundError, match=r"tokenizer='/nonexistent/tok' does not exist"):
        gym.make("TextRLHF-v0", tokenizer="/nonexistent/tok")


def test_prompts_path_that_does_not_exist(tmp_path):
    path = tmp_path / "missing.txt"
    with pytest.raises(FileNotFoundError, match=rf"prompts={re.escape(repr(str(path)))} does not exist"):
        gym.make("TextRLHF-v0", prompts=path)


def test_prompts_path_with_a_wrong_suffix(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("I liked\n")
    with pytest.raises(ValueError, match=r"prompts='.*prompts\.csv' must end in \.txt or \.jsonl"):
        gym.make("TextRLHF-v0", prompts=path)


@pytest.mark.parametrize("bad_line", ["not json", '{"text": "no prompt key"}', "[1, 2]", '{"prompt": 5}'])
def test_jsonl_prompt_file_with_a_bad_line(tmp_path, bad_line):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "I liked"}\n\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=r"prompts='.*prompts\.jsonl': line 3 .*'prompt'"):
        gym.make("TextRLHF-v0", prompts=path)


def test_empty_prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=r"prompts=.* holds no prompts"):
        gym.make("TextRLHF-v0", prompts=path)


# ---------------------------------------------------------------- reward-model output
def rm_nan(prompts, responses):
    return [float("nan")] * len(prompts)


def rm_inf(prompts, responses):
    return np.full(len(prompts), -np.inf)


def rm_two_per_episode(prompts, responses):
    return [1.0, 2.0] * len(prompts)


def rm_2d(prompts, responses):
    return np.ones((len(prompts), 2))


def rm_wrong_batch(prompts, responses):
    return [1.0] * (len(prompts) + 1)


def rm_empty(prompts, responses):
    return []


def rm_raises(prompts, responses):
    raise KeyError("boom")


@pytest.mark.parametrize("fn", [rm_nan, rm_inf])
def test_reward_model_returning_non_finite(fn):
    env = make_with_rm(fn)
    pattern = rf"reward model '{fn.__name__}' returned -?(nan|inf) for episode 0 .*finite"
    with pytest.raises(RewardModelError, match=pattern):
        finish_episode(env)


@pytest.mark.parametrize("fn", [rm_two_per_episode, rm_2d, rm_wrong_batch, rm_empty])
def test_reward_model_returning_the_wrong_shape(fn):
    env = make_with_rm(fn)
    pattern = rf"reward model '{fn.__name__}' returned shape .* for 1 episodes.*\(1,\)"
    with pytest.raises(RewardModelError, match=pattern):
        finish_episode(env)


@pytest.mark.parametrize(
    "value", ["good", ["good"], ["1.0"], None, [None], {"score": 1.0}, object(), [[1.0], [2.0, 3.0]]]
)
def test_reward_model_returning_a_non_numeric_type(value):
    def rm_bad_type(prompts, responses):
        return value

    env = make_with_rm(rm_bad_type)
    with pytest.raises(RewardModelError, match=r"reward model '.*rm_bad_type' returned .*not .*float"):
        finish_episode(env)


def test_reward_model_that_raises():
    env = make_with_rm(rm_raises)
    with pytest.raises(RewardModelError, match=r"reward model 'rm_raises' raised KeyError: 'boom'"):
        finish_episode(env)


def test_vector_reward_model_error_names_the_offending_episode():
    def rm_second_bad(prompts, responses):
        return [0.0, float("nan")][: len(prompts)]

    envs = gym.make_vec(
        "TextRLHF-v0",
        num_envs=2,
        vectorization_mode="vector_entry_point",
        reward_model=rm_second_bad,
        normalize_reward=False,
        max_new_tokens=3,
    )
    envs.reset(seed=0, options={"prompt": ["first", "second"]})
    eos = envs.unwrapped.eos_token_id
    pattern = r"'.*rm_second_bad' returned nan for episode 1 of the batch \(env slot 1\) \(prompt='second'"
    with pytest.raises(RewardModelError, match=pattern):
        envs.step(np.array([eos, eos]))


def test_numeric_reward_model_outputs_are_accepted():
    for value in ([1], np.array([[0.5]]), [np.float32(2.0)]):
        env = make_with_rm(lambda p, r, value=value: value)
        *_, info = finish_episode(env)
        assert info["rm_score"] == pytest.approx(float(np.ravel(value)[0]))


# ---------------------------------------------------------------- reward-model specs
def test_unknown_reward_model_name():
    names = (
        r"\(addition-answer, arithmetic, arithmetic-proxy, calculator-answer, default, default-response, length, "
        r"vader\)"
    )
    with pytest.raises(ValueError, match=r"reward_model='no-such-rm' is not a registered name " + names):
        gym.make("TextRLHF-v0", reward_model="no-such-rm")


def test_reward_model_module_that_cannot_be_imported():
    pattern = r"reward_model='no_such_module:f': module 'no_such_module' cannot be imported"
    with pytest.raises(ValueError, match=pattern):
        gym.make("TextRLHF-v0", reward_model="no_such_module:f")


def test_reward_model_attribute_that_does_not_exist():
    pattern = r"reward_model='textgym.rewards:nope': module 'textgym.rewards' has no attribute 'nope'"
    with pytest.raises(ValueError, match=pattern):
        gym.make("TextRLHF-v0", reward_model="textgym.rewards:nope")


def test_reward_model_object_that_is_not_a_reward_model():
    with pytest.raises(TypeError, match=r"reward_model=.*has no score\(\) and is not callable"):
        gym.make("TextRLHF-v0", reward_model=42)


def test_normalize_reward_without_stored_stats():
    with pytest.raises(ValueError, match=r"normalize_reward=True but reward model 'vader' has no stored mean/std"):
        gym.make("TextRLHF-v0", reward_model="vader", normalize_reward=True)


# ---------------------------------------------------------------- scalar arguments
@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"max_new_tokens": 0}, ValueError, r"max_new_tokens=0 must be an int >= 1"),
        ({"max_new_tokens": 2.5}, ValueError, r"max_new_tokens=2.5 must be an int >= 1"),
        ({"max_new_tokens": True}, ValueError, r"max_new_tokens=True must be an int >= 1"),
        ({"max_prompt_tokens": 0}, ValueError, r"max_prompt_tokens=0 must be an int >= 1"),
        ({"kl_coef": -1}, ValueError, r"kl_coef=-1 must be a finite float >= 0"),
        ({"kl_coef": float("nan")}, ValueError, r"kl_coef=nan must be a finite float >= 0"),
        ({"kl_coef": "0.1"}, ValueError, r"kl_coef='0.1' must be a finite float >= 0"),
        ({"missing_eos_penalty": -1}, ValueError, r"missing_eos_penalty=-1 must be a finite float >= 0"),
        ({"missing_eos_penalty": float("inf")}, ValueError, r"missing_eos_penalty=inf must be a finite float >= 0"),
        ({"missing_eos_penalty": "1"}, ValueError, r"missing_eos_penalty='1' must be a finite float >= 0"),
        ({"device": "tpu"}, ValueError, r"device='tpu' is not a torch device; use 'auto', 'cpu' or 'cuda"),
        ({"dtype": "int8"}, ValueError, r"dtype='int8' is not one of \['bfloat16', 'float16', 'float32'\]"),
        ({"reward_timeout": 0}, ValueError, r"reward_timeout=0 must be a finite float > 0 \(seconds\) or None"),
        ({"reward_timeout": "1"}, ValueError, r"reward_timeout='1' must be a finite float > 0 \(seconds\) or None"),
    ],
)
def test_bad_scalar_argument(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        gym.make("TextRLHF-v0", **kwargs)


def test_render_mode_human_goes_through_rgb_array_and_other_modes_are_refused():
    # Gymnasium's make warns, then shows the env's rgb_array frames in a window (HumanRendering)
    with pytest.warns(UserWarning, match="HumanRendering wrapper is being applied"):
        env = gym.make("TextRLHF-v0", render_mode="human")
    assert type(env).__name__ == "HumanRendering" and env.unwrapped.render_mode == "rgb_array"
    with pytest.raises(ValueError, match=r"render_mode='svg' is not one of \['ansi', 'rgb_array'\]"):
        TextRLHFEnv(render_mode="svg")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"num_envs": 0}, r"num_envs=0 must be an int >= 1"),
        ({"autoreset_mode": "bogus"}, r"autoreset_mode='bogus' is not one of .*next_step"),
        ({"render_mode": "human"}, r"render_mode='human' is not one of \['ansi', 'rgb_array'\]"),
        ({"kl_coef": -1}, r"kl_coef=-1 must be a finite float >= 0"),
    ],
)
def test_bad_vector_argument(kwargs, pattern):
    kwargs = {"num_envs": 2, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        gym.make_vec("TextRLHF-v0", vectorization_mode="vector_entry_point", **kwargs)


@pytest.mark.parametrize("bad", [-0.5, float("inf"), float("nan"), None, True])
def test_setting_a_bad_kl_coef_raises_and_keeps_the_old_value(single, bad):
    before = single.unwrapped.kl_coef
    with pytest.raises(ValueError, match=rf"kl_coef={re.escape(repr(bad))} must be a finite float >= 0"):
        single.unwrapped.kl_coef = bad
    assert single.unwrapped.kl_coef == before
    single.unwrapped.kl_coef = 0.2  # a good value is taken
    assert single.unwrapped.kl_coef == 0.2
    single.unwrapped.kl_coef = before


# ---------------------------------------------------------------- nothing half-applied
def test_failed_reset_keeps_the_rng_state(single):
    single.reset(seed=0)
    state = single.unwrapped.np_random.bit_generator.state
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        single.reset(seed=123, options={"prompt": LONG_PROMPT})
    assert single.unwrapped.np_random.bit_generator.state == state


def test_failed_vector_reset_keeps_the_slot_rngs():
    envs = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point", max_new_tokens=3)
    envs.reset(seed=0)
    states = [r.bit_generator.state for r in envs.unwrapped._slot_rngs]
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        envs.reset(seed=123, options={"prompt": LONG_PROMPT})
    assert [r.bit_generator.state for r in envs.unwrapped._slot_rngs] == states


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"seed": [1, 2, 3]}, r"seed=\[1, 2, 3\] must be an int, None or a list of 2 int/None"),
        ({"seed": 1.5}, r"seed=1.5 must be an int, None or a list of 2"),
        ({"options": {"prompt": ["only one"]}}, r"options\['prompt'\]=\['only one'\] must be a str or a list of 2 str"),
        ({"options": {"prompt": 3}}, r"options\['prompt'\]=3 must be a str or a list of 2 str"),
        ({"options": {"reset_mask": np.array([1, 0])}}, r"options\['reset_mask'\] must be a bool array of shape"),
    ],
)
def test_bad_vector_reset_arguments(vec, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        vec.reset(**kwargs)


def test_reward_model_error_leaves_the_step_retryable():
    """Decision: a step whose scorer fails is undone, so it can be retried (or the env reset)."""
    calls = []

    def rm_flaky(prompts, responses):
        calls.append(len(prompts))
        if len(calls) == 1:
            raise ConnectionError("scorer offline")
        return [0.5] * len(prompts)

    env = make_with_rm(rm_flaky)
    env.reset(seed=0, options={"prompt": "The movie was"})
    obs_before, _, _, _, _ = env.step(7)
    with pytest.raises(RewardModelError, match=r"'.*rm_flaky' raised ConnectionError: scorer offline"):
        env.step(env.unwrapped.eos_token_id)
    np.testing.assert_array_equal(env.unwrapped._engine.observation(0)["input_ids"], obs_before["input_ids"])
    obs, _, terminated, _, info = env.step(env.unwrapped.eos_token_id)  # the retry sees the same episode
    assert terminated and info["rm_score"] == 0.5
    assert obs["attention_mask"].sum() == obs_before["attention_mask"].sum() + 1


def test_vector_reward_model_error_leaves_the_step_retryable():
    calls = []

    def rm_flaky(prompts, responses):
        calls.append(len(prompts))
        if len(calls) == 1:
            raise ConnectionError("scorer offline")
        return [0.5] * len(prompts)

    envs = gym.make_vec(
        "TextRLHF-v0",
        num_envs=2,
        vectorization_mode="vector_entry_point",
        reward_model=rm_flaky,
        normalize_reward=False,
        max_new_tokens=3,
    )
    obs_before, _ = envs.reset(seed=0)
    eos = envs.unwrapped.eos_token_id
    with pytest.raises(RewardModelError, match="rm_flaky"):
        envs.step(np.array([eos, 7]))
    after = envs.unwrapped._engine.observation(slice(None))
    for key in obs_before:
        np.testing.assert_array_equal(obs_before[key], after[key])
    _, rewards, terminated, _, info = envs.step(np.array([eos, 7]))
    assert terminated.tolist() == [True, False] and info["rm_score"][0] == 0.5
    envs.step(np.array([7, 7]))  # next_step autoreset of slot 0 still happens
    assert envs.unwrapped._engine.layout.length.tolist() == [0, 2]


def test_folder_write_is_atomic(tmp_path):
    """A write that fails half-way leaves the previous folder as it was and no temporary folder behind."""
    from textgym.files import save_folder_atomically

    out = tmp_path / "ckpt"
    save_folder_atomically(out, lambda d: (d / "a.txt").write_text("v1"))

    def half_write(d):
        (d / "a.txt").write_text("v2")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_folder_atomically(out, half_write)
    assert (out / "a.txt").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    save_folder_atomically(out, lambda d: (d / "b.txt").write_text("v3"))
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_saved_folder_follows_the_umask(tmp_path):
    """mkdtemp makes 0700 folders; a saved model folder gets the permissions a plain mkdir would."""
    import os

    from textgym.files import save_folder_atomically

    old = os.umask(0o022)
    try:
        save_folder_atomically(tmp_path / "m", lambda d: None)
    finally:
        os.umask(old)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o755


# ---------------------------------------------------------------- loaders say what is wrong
def copy_model(src, dst, drop=()):
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.name not in drop:
            shutil.copy(f, dst / f.name)
    return dst


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_weights_file_names_the_argument_the_path_and_the_cause(tmp_path, damage):
    folder = copy_model(DEFAULT_LM, tmp_path / "lm")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(
        data[: len(data) // 2] if damage == "truncated" else bytes(range(256)) * 8
    )
    pattern = rf"model={re.escape(repr(str(folder)))}: model\.safetensors is truncated or corrupt \(\w+"
    with pytest.raises(ValueError, match=pattern):
        gym.make("TextRLHF-v0", model=str(folder))


def test_a_model_folder_without_a_tokenizer(tmp_path):
    folder = copy_model(DEFAULT_LM, tmp_path / "lm", drop=("tokenizer.json", "tokenizer_config.json"))
    pattern = rf"model={re.escape(repr(str(folder)))} has no tokenizer \(none of tokenizer\.json"
    with pytest.raises(FileNotFoundError, match=pattern):
        gym.make("TextRLHF-v0", model=str(folder))


def test_a_prompt_file_that_is_not_utf8(tmp_path):
    from textgym.envs import load_prompts

    path = tmp_path / "prompts.txt"
    path.write_bytes("Le film était bon\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"prompts='.*prompts\.txt' is not UTF-8 text: byte 0xe9 at offset 8"):
        load_prompts(path)


def test_a_file_given_as_a_model_folder():
    path = str(DEFAULT_LM / "config.json")
    with pytest.raises(ValueError, match=rf"model={re.escape(repr(path))} is a file, not a folder"):
        gym.make("TextRLHF-v0", model=path)


@pytest.mark.parametrize(("argument", "source"), [("model", DEFAULT_LM), ("reward_model", DEFAULT_RM)])
def test_weights_that_give_nan_are_caught_at_make_time_naming_the_model(tmp_path, argument, source):
    from safetensors.torch import load_file, save_file

    folder = copy_model(source, tmp_path / "m")
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")  # one flipped exponent bit
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{argument}={re.escape(repr(str(folder)))} gives non-finite outputs"):
        gym.make("TextRLHF-v0", **{argument: str(folder)}, gold_scorer=None)


def test_a_causal_lm_given_as_the_reward_model_is_refused():
    pattern = r"reward_model='.*lm' is not a reward model .*initialised at random .*score\.weight.*LlamaForCausalLM"
    with pytest.raises(ValueError, match=pattern):
        gym.make("TextRLHF-v0", reward_model=str(DEFAULT_LM))


def test_a_reward_model_given_as_the_model_is_refused():
    pattern = r"model='.*rm' is not a causal LM: .*in the checkpoint but unused: score\.weight .*SequenceClassification"
    with pytest.raises(ValueError, match=pattern):
        gym.make("TextRLHF-v0", model=str(DEFAULT_RM))


def test_a_missing_folder_that_looks_like_a_hub_id_fails_at_once(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online too: `runs` is a local folder, so a path
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match=r"model='runs/x' does not exist \(no such folder\)"):
        gym.make("TextRLHF-v0", model="runs/x")
    assert time.perf_counter() - start < 5


def test_an_uncached_hub_id_fails_at_once_offline():
    pattern = r"model='nobody/no-such-model' does not exist \(no such folder\) and is not a hub id in the local cache"
    with pytest.raises(FileNotFoundError, match=pattern):
        gym.make("TextRLHF-v0", model="nobody/no-such-model")


def test_max_new_tokens_beyond_the_models_positions_is_refused():
    pattern = r"max_new_tokens=200 with max_prompt_tokens=\d+ needs \d+ positions of model, more than its " \
              r"max_position_embeddings=128; allowed: max_new_tokens <= \d+"  # fmt: skip
    with pytest.raises(ValueError, match=pattern):
        gym.make("TextRLHF-v0", max_new_tokens=200)
    # π_ref fits (8 + 120 = 128), the reward model does not: it scores the EOS closing a capped response too
    with pytest.raises(ValueError, match=r"needs 129 positions of reward_model, .* allowed: max_new_tokens <= 119"):
        gym.make("TextRLHF-v0", prompts=["Hi"], max_prompt_tokens=8, max_new_tokens=120)


# ---------------------------------------------------------------- reward-model faults
def interrupted_once():
    """A reward model whose first call is interrupted: a user pressing Ctrl-C during a slow score."""
    calls = []

    def rm_interrupted(prompts, responses):
        calls.append(len(prompts))
        if len(calls) == 1:
            raise KeyboardInterrupt
        return [0.5] * len(prompts)

    return rm_interrupted


def test_a_keyboard_interrupt_in_the_reward_model_undoes_the_step():
    env = make_with_rm(interrupted_once())
    env.reset(seed=0, options={"prompt": "The movie was"})
    with pytest.raises(KeyboardInterrupt):
        env.step(env.unwrapped.eos_token_id)
    _, _, terminated, _, info = env.step(env.unwrapped.eos_token_id)  # the episode and its info are still there
    assert terminated and info["rm_score"] == 0.5 and info["prompt"] == "The movie was"


def test_a_keyboard_interrupt_in_the_reward_model_leaves_no_vector_slot_done():
    envs = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point", max_new_tokens=3,
                        reward_model=interrupted_once(), normalize_reward=False, gold_scorer=None)  # fmt: skip
    envs.reset(seed=0)
    eos = envs.unwrapped.eos_token_id
    with pytest.raises(KeyboardInterrupt):
        envs.step(np.array([eos, 7]))
    assert not envs.unwrapped._engine.done.any()
    _, _, terminated, _, info = envs.step(np.array([eos, 7]))
    assert terminated.tolist() == [True, False] and info["rm_score"][0] == 0.5
    envs.step(np.array([7, 7]))
    assert envs.unwrapped._engine.layout.length.tolist() == [0, 2]  # slot 0 was reset, not stuck done


def test_an_interrupt_inside_the_reference_forward_leaves_the_kv_cache_intact():
    envs = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point", max_new_tokens=6,
                        reward_model="length", gold_scorer=None)  # fmt: skip
    layer = envs.unwrapped.model.model.layers[2]

    def interrupted(*args, **kwargs):  # layers 0 and 1 have already grown their cache
        del layer.forward
        raise KeyboardInterrupt

    def episode(interrupt: bool):
        envs.reset(options={"prompt": ["The movie was", "I"]})
        steps = [envs.step(np.array([7, 9]))]
        if interrupt:
            layer.forward = interrupted
            with pytest.raises(KeyboardInterrupt):
                envs.step(np.array([11, 13]))
        steps += [envs.step(np.array([11, 13])), envs.step(np.array([15, 17]))]
        return [(s[0]["input_ids"], s[4]["ref_logprob"]) for s in steps]

    clean, hit = episode(False), episode(True)
    for (ids, logp), (ids_hit, logp_hit) in zip(clean, hit):
        np.testing.assert_array_equal(ids, ids_hit)
        np.testing.assert_allclose(logp, logp_hit, atol=1e-6)


def test_a_reward_model_that_hangs_times_out_naming_the_model_and_the_batch():
    release = threading.Event()

    def rm_hangs(prompts, responses):
        release.wait(30)
        return [0.0] * len(prompts)

    envs = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point", max_new_tokens=3,
                        reward_model=rm_hangs, normalize_reward=False, gold_scorer=None,
                        reward_timeout=0.2)  # fmt: skip
    envs.reset(seed=0)
    eos = envs.unwrapped.eos_token_id
    start = time.perf_counter()
    pattern = (
        r"'.*rm_hangs' did not return within reward_timeout=0.2 s on a batch of 1 episode\(s\) \(env slots \[1\]\)"
    )
    with pytest.raises(RewardModelError, match=pattern):
        envs.step(np.array([7, eos]))
    assert time.perf_counter() - start < 5
    release.set()
    _, _, terminated, _, _ = envs.step(np.array([7, eos]))  # the step was undone: the retry scores it
    assert terminated.tolist() == [False, True]


def test_a_bad_score_names_the_env_slot_not_only_the_batch_row():
    envs = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point", max_new_tokens=3,
                        reward_model=rm_nan, normalize_reward=False, gold_scorer=None)  # fmt: skip
    envs.reset(seed=0, options={"prompt": ["first", "second"]})
    pattern = r"'rm_nan' returned nan for episode 0 of the batch \(env slot 1\) \(prompt='second'"
    with pytest.raises(RewardModelError, match=pattern):
        envs.step(np.array([7, envs.unwrapped.eos_token_id]))


# ---------------------------------------------------------------- smaller
def test_a_refused_vector_reset_seed_reseeds_nothing(vec):
    vec.reset(seed=0)
    slots = [r.bit_generator.state for r in vec.unwrapped._slot_rngs]
    env_rng = vec.unwrapped.np_random.bit_generator.state
    with pytest.raises(ValueError, match=r"seed=\[0, -1\] must be an int, None or a list of 2 int/None \(ints >= 0\)"):
        vec.reset(seed=[0, -1])
    assert [r.bit_generator.state for r in vec.unwrapped._slot_rngs] == slots
    assert vec.unwrapped.np_random.bit_generator.state == env_rng


@pytest.mark.parametrize("chat", [False, True])
def test_special_token_text_in_a_prompt_stays_text(tmp_path, chat):
    from textgym.models import load_tokenizer

    tok = load_tokenizer()
    kwargs = {}
    if chat:
        tok.chat_template = "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
        tok.save_pretrained(tmp_path / "tok")
        kwargs = {"tokenizer": str(tmp_path / "tok"), "chat_template": True}
    prompt = f"The {tok.pad_token} movie {tok.eos_token}"
    env = gym.make("TextRLHF-v0", prompts=[prompt], max_new_tokens=2, reward_model="length", gold_scorer=None,
                   **kwargs)  # fmt: skip
    obs, _ = env.reset(seed=0)
    P = env.unwrapped.max_prompt_tokens
    ids = obs["input_ids"][:P][obs["attention_mask"][:P] == 1].tolist()
    assert ids[0] == tok.bos_token_id  # BOS (written by the tokenizer or the template) is still a special token
    assert tok.pad_token_id not in ids and tok.eos_token_id not in ids


def test_a_long_prompt_is_not_echoed_in_full(single):
    with pytest.raises(ValueError, match=r"\(9800 characters\) is \d+ tokens, more than max_prompt_tokens") as err:
        single.reset(options={"prompt": "The movie was " * 700})
    assert len(str(err.value)) < 400


@pytest.mark.parametrize("command", [["train", "--out", "{tmp}/run"], ["play"], ["eval"]])
def test_a_negative_seed_names_the_flag(command, tmp_path, capsys):
    from textgym.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([c.replace("{tmp}", str(tmp_path)) for c in command] + ["--seed", "-1"])
    assert exit_.value.code == 2
    assert "argument --seed: '-1' is not an int in [0, 2**32 - 1]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "env_id, kwargs, match",
    [
        ("TextRLHF-v0", {"max_new_token": 8}, r"TextRLHFEnv got an unexpected keyword argument 'max_new_token'; did "
                                              r"you mean 'max_new_tokens'\? it takes: action_mask_top_p, .*tokenizer"),
        ("TextMultiTurn-v0", {"partner": "calculator", "max_turn": 2},
         r"TextMultiTurnEnv got an unexpected keyword argument 'max_turn'; did you mean 'max_turns'\? .*partner"),
        ("TextRLHF-v0", {"partner": "calculator"}, r"TextRLHFEnv is single-turn: partner= is an argument of a "
                                                   r"conversation, gym.make\('TextMultiTurn-v0', partner=...\)"),
        ("TextArithmetic-v0", {"max_turns": 2}, r"is single-turn: max_turns= is an argument of a conversation"),
        ("TextRLHF-v0", {"zzz": 1}, r"unexpected keyword argument 'zzz'; it takes: action_mask_top_p"),
    ],
)  # fmt: skip
def test_a_mistyped_or_misplaced_env_argument_names_the_env_the_close_match_and_what_it_takes(env_id, kwargs, match):
    """Issue 42.9: the engine's own TypeError named neither the env nor its arguments; partner= on TextRLHF-v0
    silently made a conversation."""
    with pytest.raises(TypeError, match=match):
        gym.make(env_id, **kwargs)
    with pytest.raises(TypeError, match=match.replace("Env ", "VectorEnv ")):
        gym.make_vec(env_id, num_envs=2, vectorization_mode="vector_entry_point", **kwargs)


def test_a_textarena_game_with_a_capitalised_prefix_is_refused_naming_the_prefix():
    with pytest.raises(ValueError, match=r"partner='TextArena:GuessTheNumber-v0': TextArena games are named with a "
                                         r"lower-case prefix, 'textarena:GuessTheNumber-v0'"):  # fmt: skip
        gym.make("TextMultiTurn-v0", partner="TextArena:GuessTheNumber-v0")
