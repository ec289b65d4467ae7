"""TextRLHF-v0: checkers, the reward contract, the KV cache, vectorisation, determinism."""

import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import ref_policy, run_episode
from gymnasium.utils.env_checker import check_env as gym_check_env

from textgym.models import response_logprobs


def full_forward_ref_logprobs(env, final_obs):
    """log π_ref of every response token from ONE uncached forward over the finished sequence."""
    base = env.unwrapped
    ids = torch.as_tensor(final_obs["input_ids"]).reshape(1, -1)
    mask = torch.as_tensor(final_obs["attention_mask"]).reshape(1, -1)
    with torch.no_grad():
        lp, _ = response_logprobs(base.model, ids, mask, base.max_prompt_tokens)
    n = int(mask[0, base.max_prompt_tokens :].sum())
    return lp[0, :n].double().numpy()


# ---------------------------------------------------------------- checkers
def test_gymnasium_env_checker(env):
    gym_check_env(env.unwrapped, skip_render_check=False)


def test_sb3_env_checker(env):
    from stable_baselines3.common.env_checker import check_env

    check_env(env.unwrapped, warn=True)


def test_torchrl_check_env_specs_single_and_vector():
    from torchrl.envs import GymWrapper
    from torchrl.envs.utils import check_env_specs

    check_env_specs(GymWrapper(gym.make("TextRLHF-v0", max_new_tokens=6)), seed=0)
    vec = gym.make_vec(
        "TextRLHF-v0", num_envs=3, vectorization_mode="vector_entry_point", max_new_tokens=6, autoreset_mode="disabled"
    )
    check_env_specs(GymWrapper(vec), seed=0)


def test_spaces_follow_the_design(env):
    base = env.unwrapped
    L = base.max_prompt_tokens + base.max_new_tokens
    assert isinstance(env.action_space, gym.spaces.Discrete) and env.action_space.start == 0
    assert env.action_space.n == base.model.config.vocab_size
    for key in ("input_ids", "attention_mask"):
        space = env.observation_space[key]
        assert space.shape == (L,) and space.dtype == np.int64
    assert base.eos_token_id != base.pad_token_id


def test_make_is_fast_and_offline():
    start = time.perf_counter()
    gym.make("TextRLHF-v0")
    assert time.perf_counter() - start < 2.0


# ---------------------------------------------------------------- reward contract
def test_reward_is_beta_ref_logprob_plus_score_at_the_end(env):
    env.unwrapped.kl_coef = 0.1
    _, actions, rewards, infos = run_episode(env, ref_policy(env), seed=1)
    ref = np.array([i["ref_logprob"] for i in infos])
    last = infos[-1]
    assert np.allclose(rewards[:-1], 0.1 * ref[:-1])
    assert rewards[-1] == pytest.approx(0.1 * ref[-1] + last["score_reward"] - last["missing_eos_penalty"])
    # the episode return is the score plus beta times the summed reference log-likelihood
    assert rewards.sum() == pytest.approx(last["score_reward"] + 0.1 * ref.sum() - last["missing_eos_penalty"])
    mean, std, *_ = env.unwrapped.unwrapped.reward_norm
    assert last["score_reward"] == pytest.approx((last["rm_score"] - mean) / std)
    for key in ("rm_score", "gold_score", "prompt", "response", "response_length"):
        assert key in last
    assert -1.0 <= last["gold_score"] <= 1.0
    assert last["response_length"] == len(actions)


def test_agent_side_kl_identity(env):
    """return − β·Σ log π = Σ_t −β·(log π − log π_ref) + score: the seed's per-token KL reward."""
    beta = 0.2
    env.unwrapped.kl_coef = beta
    policy = ref_policy(env, temperature=1.3)  # not π_ref itself: the KL is non-zero
    obs, _ = env.reset(seed=3)
    ret, logps, infos = 0.0, [], []
    while True:
        a, lp = policy.act(obs)
        obs, r, term, trunc, info = env.step(int(a[0]))
        ret += r
        logps.append(float(lp[0]))
        infos.append(info)
        if term or trunc:
            break
    ref = np.array([i["ref_logprob"] for i in infos])
    seed_rewards = -beta * (np.array(logps) - ref)
    seed_rewards[-1] += infos[-1]["score_reward"] - infos[-1]["missing_eos_penalty"]
    assert ret - beta * sum(logps) == pytest.approx(seed_rewards.sum(), abs=1e-9)


def test_entropy_identity_for_a_deterministic_policy(env):
    """A greedy policy has zero entropy: its return is exactly score − β·KL(π‖π_ref)."""
    beta = 0.05
    env.unwrapped.kl_coef = beta
    _, actions, rewards, infos = run_episode(env, ref_policy(env, temperature=0), seed=4)
    ref = np.array([i["ref_logprob"] for i in infos])
    kl = -ref.sum()  # log π(a|s) = 0 for a deterministic policy
    score = infos[-1]["score_reward"] - infos[-1]["missing_eos_penalty"]
    assert rewards.sum() == pytest.approx(score - beta * kl)


def test_the_length_cap_is_terminal_not_truncated():
    """The observation encodes the step and the score is paid at the cap: a terminal state of this MDP."""
    env = gym.make("TextRLHF-v0", max_new_tokens=3, missing_eos_penalty=2.0)
    env.reset(seed=0)
    non_eos = 5 if env.unwrapped.eos_token_id != 5 else 6
    for _ in range(3):
        _, r, term, trunc, info = env.step(non_eos)
    assert term and not trunc and info["length_capped"].item() is True  # np.bool_: TorchRL readers need a dtype
    assert info["missing_eos_penalty"] == 2.0 and info["eos_penalty"] == -2.0
    assert r == pytest.approx(env.unwrapped.kl_coef * info["ref_logprob"] + info["score_reward"] - 2.0)


def test_terminated_on_eos(env):
    env.reset(seed=0)
    _, _, term, trunc, info = env.step(env.unwrapped.eos_token_id)
    assert term and not trunc and info["length_capped"].item() is False
    assert info["response"] == "" and info["response_length"] == 1


def _with_generation_stop_ids(tmp_path, stop_ids):
    """The embedded LM saved with ``generation_config.eos_token_id = stop_ids`` (a chat model's end-of-turn)."""
    from textgym.models import load_causal_lm, load_tokenizer

    model = load_causal_lm()
    model.generation_config.eos_token_id = stop_ids
    model.save_pretrained(tmp_path / "lm")
    load_tokenizer().save_pretrained(tmp_path / "lm")
    return str(tmp_path / "lm")


def test_an_episode_ends_on_any_of_the_models_stop_ids(tmp_path):
    end_of_turn = 7
    # another π_ref folder: the embedded RM's stored scale is not its (refused otherwise)
    env = gym.make("TextRLHF-v0", model=_with_generation_stop_ids(tmp_path, [2, end_of_turn]), max_new_tokens=6,
                   normalize_reward=False)  # fmt: skip
    assert env.unwrapped.stop_token_ids == (2, end_of_turn)
    env.reset(seed=0, options={"prompt": "The movie"})
    _, _, term, _, info = env.step(20)
    assert not term
    _, _, term, trunc, info = env.step(end_of_turn)
    assert term and not trunc and not info["length_capped"] and info["response_length"] == 2
    assert info["response"] == env.unwrapped.tokenizer.decode([20])  # the stop id is not text
    env.reset(seed=0)
    assert env.step(2)[2]  # EOS still ends it


def test_stop_token_ids_argument(tmp_path):
    env = gym.make("TextRLHF-v0", stop_token_ids=[9], max_new_tokens=4)
    env.reset(seed=0)
    assert not env.step(2)[2] and env.step(9)[2]  # only the given ids stop
    for bad, pattern in (([], "non-empty"), ([10**6], r"token ids in \[0, "), ("2", "must be a list")):
        with pytest.raises((ValueError, TypeError), match=pattern):
            gym.make("TextRLHF-v0", stop_token_ids=bad)


def test_a_pad_token_that_is_also_a_stop_id_is_replaced(tmp_path):
    """Chat models that pad with a token they also stop on (e.g. <|endoftext|>): PAD moves, EOS/PAD stay distinct."""
    tok_pad = 0  # the embedded tokenizer's <pad>
    env = gym.make("TextRLHF-v0", model=_with_generation_stop_ids(tmp_path, [2, tok_pad]), max_new_tokens=3,
                   prompts=["The movie"], max_prompt_tokens=6, normalize_reward=False)  # fmt: skip
    base = env.unwrapped
    assert tok_pad in base.stop_token_ids and base.pad_token_id not in base.stop_token_ids
    obs, _ = env.reset(seed=0)
    padding = obs["input_ids"][obs["attention_mask"] == 0]
    assert padding.size and (padding == base.pad_token_id).all()
    assert env.step(tok_pad)[2]  # ... and the old PAD now ends an episode


def test_prompts_through_the_chat_template(tmp_path):
    from textgym.models import load_tokenizer

    tok = load_tokenizer()
    tok.chat_template = "{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    tok.save_pretrained(tmp_path / "tok")
    env = gym.make("TextRLHF-v0", tokenizer=str(tmp_path / "tok"), chat_template=True, max_new_tokens=4,
                   prompts=["Write a short movie review."])  # fmt: skip
    obs, _ = env.reset(seed=0)
    expected = tok("<bos>user: Write a short movie review.\nassistant:", add_special_tokens=False)["input_ids"]
    P = env.unwrapped.max_prompt_tokens
    assert obs["input_ids"][P - len(expected) : P].tolist() == expected
    assert obs["attention_mask"][:P].sum() == len(expected)
    assert env.unwrapped.encode_prompts(["Write a short movie review."]) == [expected]  # what another tool gets
    with pytest.raises(ValueError, match="chat_template=True but tokenizer .* has no chat template"):
        gym.make("TextRLHF-v0", chat_template=True)


# ---------------------------------------------------------------- KV cache
def test_cached_logprobs_equal_full_forward(env):
    for seed in range(3):
        obs, _, _, infos = run_episode(env, ref_policy(env, seed=seed), seed=seed)
        stepped = np.array([i["ref_logprob"] for i in infos])
        np.testing.assert_allclose(stepped, full_forward_ref_logprobs(env, obs[-1]), atol=1e-5)


def test_vector_cache_with_staggered_resets_equals_full_forward():
    """Slots ending at different steps (autoreset refills rows mid-batch) keep exact log-probs."""
    envs = gym.make_vec("TextRLHF-v0", num_envs=4, vectorization_mode="vector_entry_point", max_new_tokens=10)
    policy = ref_policy(envs, seed=7)
    obs, _ = envs.reset(seed=0)
    stepped = [[] for _ in range(4)]
    checked = 0
    for _ in range(40):
        a, _ = policy.act(obs)
        obs, _, term, trunc, info = envs.step(a.numpy())
        for i in range(4):
            if info.get("_ref_logprob", np.zeros(4, bool))[i]:
                stepped[i].append(info["ref_logprob"][i])
            if term[i] or trunc[i]:
                single = {k: v[i] for k, v in obs.items()}
                np.testing.assert_allclose(stepped[i], full_forward_ref_logprobs(envs, single), atol=1e-5)
                stepped[i] = []
                checked += 1
    assert checked >= 8


def test_policy_cached_logprobs_equal_teacher_forcing(env):
    policy = ref_policy(env, seed=2, temperature=0.7)
    obs, _ = env.reset(seed=2)
    logps = []
    while True:
        a, lp = policy.act(obs)
        logps.append(float(lp[0]))
        obs, _, term, trunc, _ = env.step(int(a[0]))
        if term or trunc:
            break
    ids = torch.as_tensor(obs["input_ids"])[None]
    mask = torch.as_tensor(obs["attention_mask"])[None]
    with torch.no_grad():
        tf, _ = response_logprobs(env.unwrapped.model, ids, mask, env.unwrapped.max_prompt_tokens, temperature=0.7)
    np.testing.assert_allclose(logps, tf[0, : len(logps)].numpy(), atol=1e-5)


# ---------------------------------------------------------------- vectorisation and determinism
def _drive(envs, n_envs, steps, seed):
    rng = np.random.default_rng(seed)
    obs, _ = envs.reset(seed=seed)
    trace = [obs["input_ids"].copy()]
    rewards, dones = [], []
    vocab = envs.single_action_space.n
    for _ in range(steps):
        # mostly EOS-free random tokens with an occasional EOS so slots end at different steps
        a = rng.integers(3, vocab, size=n_envs)
        a[rng.random(n_envs) < 0.15] = envs.unwrapped.eos_token_id if hasattr(envs, "unwrapped") else 2
        obs, r, te, tr, _ = envs.step(a)
        trace.append(obs["input_ids"].copy())
        rewards.append(r.copy())
        dones.append(te | tr)
    return np.array(trace), np.array(rewards), np.array(dones)


def test_vector_env_equals_sync_vector_env():
    kwargs = dict(max_new_tokens=6)
    native = gym.make_vec("TextRLHF-v0", num_envs=3, vectorization_mode="vector_entry_point", **kwargs)
    sync = gym.make_vec("TextRLHF-v0", num_envs=3, vectorization_mode="sync", **kwargs)
    eos = native.unwrapped.eos_token_id
    sync.unwrapped.eos_token_id = eos  # _drive reads it from .unwrapped
    t1, r1, d1 = _drive(native, 3, 30, seed=5)
    t2, r2, d2 = _drive(sync, 3, 30, seed=5)
    np.testing.assert_array_equal(t1, t2)
    np.testing.assert_array_equal(d1, d2)
    np.testing.assert_allclose(r1, r2, atol=1e-5)
    assert d1.sum() >= 6


def test_same_seed_same_trajectories():
    make = lambda: gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point", max_new_tokens=5)
    a, b = _drive(make(), 2, 12, seed=11), _drive(make(), 2, 12, seed=11)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    env = gym.make("TextRLHF-v0")
    prompts = [env.reset(seed=s)[1]["prompt"] for s in (0, 1, 0)]
    assert prompts[0] == prompts[2]


@pytest.mark.parametrize("mode", ["next_step", "same_step", "disabled"])
def test_autoreset_modes(mode):
    envs = gym.make_vec(
        "TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point", max_new_tokens=3, autoreset_mode=mode
    )
    assert envs.metadata["autoreset_mode"].name.lower() == mode == envs.autoreset_mode.name.lower()
    envs.reset(seed=0)
    eos = envs.unwrapped.eos_token_id
    obs, r, te, tr, info = envs.step(np.array([eos, 7]))  # slot 0 ends now, slot 1 goes on
    assert te.tolist() == [True, False]
    P = envs.unwrapped.max_prompt_tokens
    if mode == "same_step":
        assert info["_final_obs"].tolist() == [True, False]
        assert info["final_obs"][0]["input_ids"][P] == eos
        assert obs["attention_mask"][0, P:].sum() == 0  # already reset
        assert "rm_score" in info["final_info"]
    elif mode == "next_step":
        obs, r, te, tr, info = envs.step(np.array([7, 7]))
        assert r[0] == 0.0 and not te[0] and obs["attention_mask"][0, P:].sum() == 0
    else:  # the finished slot waits: its action is ignored until reset_mask resets it
        obs, r, te, tr, info = envs.step(np.array([7, 7]))
        assert r[0] == 0.0 and not te[0] and info["_ref_logprob"].tolist() == [False, True]
        assert obs["attention_mask"][0, P:].sum() == 1 and obs["input_ids"][0, P] == eos
        envs.step(np.array([7, 7]))  # slot 1 reaches the cap of 3: now every slot waits
        with pytest.raises(RuntimeError, match="every slot finished.*reset_mask"):
            envs.step(np.array([7, 7]))  # a loop that forgets to reset fails instead of spinning
        obs, _ = envs.reset(options={"reset_mask": np.array([True, False])})
        assert obs["attention_mask"][0, P:].sum() == 0 and obs["attention_mask"][1, P:].sum() == 3
        envs.step(np.array([7, 7]))


def test_render_ansi():
    env = gym.make("TextRLHF-v0", render_mode="ansi")
    env.reset(seed=0, options={"prompt": "The movie was"})
    assert env.render() == "The movie was"
    env.step(env.unwrapped.tokenizer(" good", add_special_tokens=False)["input_ids"][0])
    assert env.render().startswith("The movie was")
    assert len(env.render()) > len("The movie was")


def test_empty_prompt_starts_from_bos(env):
    obs, _ = env.reset(seed=0, options={"prompt": ""})
    P = env.unwrapped.max_prompt_tokens
    assert obs["attention_mask"][:P].sum() == 1
    assert obs["input_ids"][P - 1] == env.unwrapped.tokenizer.bos_token_id


def test_prompt_options_and_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("I liked\nThe film\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "I liked"}\n{"prompt": "The film"}\n')
    for source in (txt, jsonl, ["I liked", "The film"]):
        env = gym.make("TextRLHF-v0", prompts=source)
        seen = {env.reset(seed=s)[1]["prompt"] for s in range(12)}
        assert seen == {"I liked", "The film"}


def test_any_hf_causal_lm_works_gpt2_architecture(tmp_path):
    """A non-Llama model (GPT-2 architecture, random weights, our tokenizer) runs with exact cached log-probs."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from textgym.models import DEFAULT_LM

    tok = AutoTokenizer.from_pretrained(DEFAULT_LM)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=128)).save_pretrained(
        tmp_path / "gpt2"
    )
    tok.save_pretrained(tmp_path / "gpt2")
    env = gym.make("TextRLHF-v0", model=str(tmp_path / "gpt2"), max_new_tokens=8, normalize_reward=False)
    obs, _, _, infos = run_episode(env, ref_policy(env), seed=0)
    stepped = np.array([i["ref_logprob"] for i in infos])
    np.testing.assert_allclose(stepped, full_forward_ref_logprobs(env, obs[-1]), atol=1e-5)
    assert np.isfinite(infos[-1]["rm_score"])


# ---------------------------------------------------------------- reward normalisation
def test_the_stored_normalisation_says_where_it_was_measured_and_warns_elsewhere():
    norm = gym.make("TextRLHF-v0").unwrapped.reward_norm
    assert (norm.max_new_tokens, norm.temperature) == (32, 1.0)
    with pytest.warns(UserWarning, match=r"under π_ref at max_new_tokens=32 .* this env runs max_new_tokens=16"):
        gym.make("TextRLHF-v0", max_new_tokens=16)


def test_normalisation_with_given_mean_and_std():
    env = gym.make("TextRLHF-v0", max_new_tokens=3, normalize_reward=(1.0, 2.0))
    env.reset(seed=0)
    for _ in range(3):
        *_, info = env.step(5)
    assert info["score_reward"] == pytest.approx((info["rm_score"] - 1.0) / 2.0)
    with pytest.raises(ValueError, match=r"normalize_reward=\(1.0, 0.0\) must be a bool, None or a \(mean, std > 0\)"):
        gym.make("TextRLHF-v0", normalize_reward=(1.0, 0.0))


def test_the_shipped_review_request_sets_are_what_their_templates_write():
    """Issue 25: a held-out set worded unlike the training requests, reproducible from the opening files."""
    from textgym.assets import PROMPT_SETS
    from textgym.assets.review_requests import TEMPLATES, request_lines
    from textgym.envs import load_prompts

    for name in TEMPLATES:
        assert PROMPT_SETS[name].read_text(encoding="utf-8").splitlines() == request_lines(name)
    reworded = load_prompts("review-requests-reworded")
    assert reworded[0] == 'Tell a friend what you thought of a movie you just saw, starting with "The movie was".'
    assert len(reworded) == len(load_prompts("review-requests-eval"))  # the same held-out openings
    assert not set(reworded) & set(load_prompts("review-requests"))
