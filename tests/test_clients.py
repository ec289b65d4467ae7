"""The env and agents through their users' own calls: SB3's make_vec_env, VecNormalize and evaluate_policy,
Gymnasium's async vector env, TorchRL's info readers and its own PPO pieces, the CLI's eval and
reward-model routes, and the reward-model registry."""

import runpy
import subprocess
import sys
import threading
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

from textgym.agents.sb3 import LMPolicy
from textgym.cli import main
from textgym.models import load_tokenizer
from textgym.rewards import (
    Episodes,
    KeywordReward,
    WeightedSumReward,
    make_reward_model,
    register,
    registry,
    score_checked,
)

ROOT = Path(__file__).resolve().parents[1]
EPS = Episodes(prompts=["The movie", "I saw"], responses=[" was great fun.", " was bad."], prompt_ids=[[1], [1]],
               response_ids=[[7, 2], [9, 2]])  # fmt: skip


def run(cmd, cwd=ROOT, timeout=300):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


# ---------------------------------------------------------------- Stable-Baselines3
def test_sb3_make_vec_env_renders_rgb_array_frames():
    """make_vec_env asks every env for render_mode='rgb_array': the text comes back as a frame."""
    venv = make_vec_env("TextRLHF-v0", n_envs=2, env_kwargs={"max_new_tokens": 4})
    venv.reset()
    frames = venv.get_images()
    assert len(frames) == 2 and all(f.shape == (256, 512, 3) and f.dtype == np.uint8 for f in frames)
    assert (frames[0] < 128).any()  # some text drawn
    venv.close()


SB3_SCRIPT = """
import gymnasium as gym
import numpy as np
import textgym  # noqa: F401
from stable_baselines3 import PPO
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import SubprocVecEnv, VecNormalize
from textgym.agents.sb3 import LMPolicy

if __name__ == "__main__":
    venv = make_vec_env("TextRLHF-v0", n_envs=2, vec_env_cls=SubprocVecEnv, seed=0, env_kwargs={"max_new_tokens": 4})
    venv = VecNormalize(venv, norm_obs=False)  # token ids are categories: only rewards may be normalised
    model = PPO(LMPolicy, venv, n_steps=4, batch_size=8, n_epochs=1, seed=0)
    model.learn(8)
    mean, std = evaluate_policy(model, venv, n_eval_episodes=2)
    frames = venv.get_images()
    venv.close()
    assert np.isfinite(mean) and [f.shape for f in frames] == [(256, 512, 3)] * 2
    print("ok", mean)
"""


def test_sb3_subproc_vec_env_with_vecnormalize_and_evaluate_policy(tmp_path):
    """SB3's usual pipeline in a user's script: SubprocVecEnv workers, VecNormalize, PPO, evaluate_policy."""
    script = tmp_path / "train_sb3.py"
    script.write_text(SB3_SCRIPT)
    assert "ok" in run([sys.executable, str(script)], cwd=tmp_path).stdout


def test_vecnormalize_norm_obs_is_refused_with_the_fix():
    """VecNormalize's default norm_obs=True standardises the token ids: a clear error, not an IndexError."""
    venv = VecNormalize(DummyVecEnv([lambda: gym.make("TextRLHF-v0", max_new_tokens=4)]))
    model = PPO(LMPolicy, venv, n_steps=4, batch_size=4, n_epochs=1, seed=0)
    with pytest.raises(ValueError, match=r"observations\['input_ids'\].*VecNormalize\(venv, norm_obs=False\)"):
        model.learn(4)


# ---------------------------------------------------------------- Gymnasium's async vector env
def test_async_vector_env_after_a_torch_op_in_the_parent():
    """AsyncVectorEnv forks by default; once this process has run a parallel torch op, the workers used to hang."""
    torch.randn(2_000_000).exp_()  # a parallel op: GNU OpenMP's thread pool is up in this process
    box = {}

    def rollout():
        envs = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="async", max_new_tokens=3)
        box["envs"] = envs
        envs.reset(seed=0)
        for _ in range(3):
            box["step"] = envs.step(np.array([5, 5]))

    thread = threading.Thread(target=rollout, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the async vector env hung"
    _, reward, terminated, _, info = box["step"]
    box["envs"].close()
    assert terminated.all() and info["_rm_score"].all() and np.isfinite(info["rm_score"]).all()


# ---------------------------------------------------------------- TorchRL
def test_torchrl_info_reader_single_env():
    from torchrl.envs import GymWrapper
    from torchrl.envs.gym_like import default_info_dict_reader

    base = gym.make("TextRLHF-v0", max_new_tokens=4)
    env = GymWrapper(base)
    env.set_info_dict_reader(default_info_dict_reader(["rm_score", "ref_logprob", "gold_score"]))
    env.set_seed(0)
    td = env.rollout(10)  # stops at the episode's end (at most 4 tokens)
    nxt = td["next"]
    assert nxt["done"][-1].all() and (nxt["ref_logprob"] < 0).all()
    assert nxt["rm_score"][-1] != 0 and (nxt["rm_score"][:-1] == 0).all()
    assert -1 <= nxt["gold_score"][-1] <= 1
    beta = base.unwrapped.kl_coef
    torch.testing.assert_close(nxt["reward"][:-1, 0].double(), beta * nxt["ref_logprob"][:-1], atol=1e-5, rtol=0)


def test_torchrl_info_reader_vector_env():
    from torchrl.data import Unbounded
    from torchrl.envs import GymWrapper
    from torchrl.envs.gym_like import default_info_dict_reader

    n = 3
    vec = gym.make_vec("TextRLHF-v0", num_envs=n, vectorization_mode="vector_entry_point", max_new_tokens=4,
                       autoreset_mode="disabled")  # fmt: skip
    env = GymWrapper(vec)
    keys = ["rm_score", "ref_logprob", "gold_score"]
    env.set_info_dict_reader(default_info_dict_reader(keys, spec=[Unbounded((n,), dtype=torch.float64)] * 3))
    env.set_seed(0)
    td = env.rollout(6, break_when_any_done=False)  # (n, 6): every slot ends by step 4, then is reset
    done = td["next", "done"].squeeze(-1)
    assert done.any(1).all()
    assert (td["next", "rm_score"][done] != 0).all() and (td["next", "rm_score"][~done] == 0).all()
    assert (td["next", "ref_logprob"] < 0).all()


def test_torchrl_example_trains_with_torchrl_pieces_only():
    out = run([sys.executable, "examples/torchrl_ppo.py", "--frames", "128", "--frames-per-batch", "64",
               "--minibatch", "32", "--max-new-tokens", "6"]).stdout  # fmt: skip
    assert out.count("episodes, RM score") == 2


# ---------------------------------------------------------------- the CLI
def _other_vocabulary_lm(path: Path) -> Path:
    """A tiny random Llama with 3000 tokens (π_ref has 2048) and the embedded tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=3000, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    load_tokenizer().save_pretrained(path)
    return path


def test_eval_refuses_a_policy_with_another_vocabulary(tmp_path, capsys):
    policy = _other_vocabulary_lm(tmp_path / "other")
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--policy", str(policy), "--episodes", "4", "--num-envs", "4", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "vocabulary of 3000 tokens, π_ref has 2048" in err and "--ref-model" in err


def test_eval_shows_progress(capsys):
    main(["eval", "--episodes", "4", "--num-envs", "2", "--max-new-tokens", "3"])
    captured = capsys.readouterr()
    assert "pi_ref:" in captured.out
    assert "pi_ref:" in captured.err and "/4 [" in captured.err and "episode" in captured.err  # tqdm, on stderr


def test_reward_model_module_in_the_working_directory(tmp_path):
    """The console script finds `myrm.py` in the working directory, as `python -m` would."""
    (tmp_path / "myrm.py").write_text("def score(prompts, responses):\n    return [0.5] * len(responses)\n")
    textgym = Path(sys.executable).with_name("textgym")
    out = run([str(textgym), "play", "--reward-model", "myrm:score", "--episodes", "1", "--max-new-tokens", "3"],
              cwd=tmp_path).stdout  # fmt: skip
    assert "rm_score +0.500" in out and "normalised" not in out  # a plug-in RM: raw scores only


# ---------------------------------------------------------------- the reward-model registry
def test_register_a_factory_that_takes_no_arguments(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the names registered here go away after
    register("test-fun-words", lambda: KeywordReward(["great", "fun"]))
    env = gym.make("TextRLHF-v0", reward_model="test-fun-words", normalize_reward=False, max_new_tokens=3)
    env.reset(seed=0)
    info = env.step(env.unwrapped.eos_token_id)[4]
    assert info["rm_score"] == 0.0  # the empty response holds no keyword
    register("test-on-device", lambda device="cpu": KeywordReward("great"))  # gets the env's device
    assert make_reward_model("test-on-device", device=torch.device("cpu")).name == "keywords(great)"


def test_weighted_sum_resolves_its_parts_at_construction(tmp_path):
    both = WeightedSumReward([(0.5, "vader"), (2.0, lambda prompts, responses: [1.0] * len(responses))])
    vader = make_reward_model("vader")
    np.testing.assert_allclose(score_checked(both, EPS), 0.5 * score_checked(vader, EPS) + 2.0)
    with pytest.raises(ValueError, match=r"parts\[1\]='no-such-rm' is not a registered name"):
        WeightedSumReward([(1.0, "vader"), (1.0, "no-such-rm")])
    with pytest.raises(ValueError, match=r"parts\[0\] has weight=nan"):
        WeightedSumReward([(float("nan"), "vader")])
    with pytest.raises(ValueError, match=r"parts\[0\]='vader' must be a \(weight, reward_model\) pair"):
        WeightedSumReward(["vader"])


def test_help_shows_defaults(capsys):
    for argv, shown in (
        (["train", "--help"], ("(default: 4096)", "(default: 0.2)")),
        (["eval", "--help"], ("(default: 128)",)),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert all(s in text for s in shown), (argv, shown)


def test_train_help_gives_every_fields_whole_docstring_entry():
    """Issue 26.7: a field's help is its whole ``Attributes:`` entry, continuation lines included.

    ``--algo`` used to stop mid-sentence ("``grpo`` (no critic: each (default: ppo)") and fields
    documented together (``learning_rate, critic_learning_rate:``) had no help at all.
    """
    import argparse
    from dataclasses import fields

    from textgym.agents.ppo.config import PPOConfig, add_config_args

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    helps = {a.dest: " ".join(a.help.split()) for a in parser._actions if a.help}
    for f in (f for f in fields(PPOConfig) if f.init):  # derived fields are no flags
        text = helps[f.name].rsplit(" (default: ", 1)[0]
        assert text and text[-1] in ".)", (f.name, text)  # a whole sentence, never cut
    assert helps["algo"].startswith("ppo (clipped surrogate") and "Ahmadian et al., 2024)." in helps["algo"]
    assert helps["learning_rate"].startswith("the policy's AdamW step size") and helps["lmbda"].startswith("GAE's λ")


def test_train_help_groups_every_field_once_and_lists_the_choices():
    import argparse
    from dataclasses import fields

    from textgym.agents.ppo.config import FIELD_GROUPS, PPOConfig, add_config_args

    grouped = [name for names in FIELD_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in fields(PPOConfig) if f.init)  # each once, none left out
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    titles = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    assert (
        titles["algorithm"] >= {"algo", "kl_coef", "clip_epsilon"}
        and "num_workers" in titles["cluster (Ray rollout workers)"]
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--algo", "dpo"])  # refused by argparse, naming the choices


def test_quickstart_is_reproducible(capsys):
    """The quickstart's reset(seed=0) and seeded sampler give one episode, whatever torch's global RNG holds."""
    outs = set()
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
        outs.add(capsys.readouterr().out)
    assert len(outs) == 1


# ---------------------------------------------------------------- Hugging Face datasets
def test_prompts_from_a_saved_dataset_folder_or_a_cached_name(tmp_path, monkeypatch, capsys):
    import datasets

    from textgym.envs import load_prompts

    data = datasets.Dataset.from_dict({"text": ["The movie was", "I watched"], "label": [0, 1]})
    data.save_to_disk(str(tmp_path / "ds"))
    env = gym.make("TextRLHF-v0", prompts=str(tmp_path / "ds"), prompt_column="text", max_new_tokens=3)
    assert env.unwrapped.prompts == ["The movie was", "I watched"]
    main(["play", "--prompts", str(tmp_path / "ds"), "--prompt-column", "text", "--episodes", "1",
          "--max-new-tokens", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert "'The movie was' ->" in out or "'I watched' ->" in out
    with pytest.raises(ValueError, match=r"has no column 'prompt'; its columns are \['text', 'label'\]"):
        load_prompts(str(tmp_path / "ds"))
    datasets.DatasetDict({"test": data, "validation": data}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"splits \['test', 'validation'\] and no 'train'"):
        load_prompts(str(tmp_path / "dd"), "text")
    assert load_prompts(str(tmp_path / "dd" / "test"), "text") == ["The movie was", "I watched"]
    # a name in the local cache goes to datasets.load_dataset (offline here: stubbed to see the call)
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: calls.append((name, split)) or data)
    assert load_prompts("someorg/reviews:test", "text") == ["The movie was", "I watched"]
    assert calls == [("someorg/reviews", "test")]
    with pytest.raises(FileNotFoundError, match="no_such_prompts.txt' does not exist"):
        load_prompts("no_such_prompts.txt")
