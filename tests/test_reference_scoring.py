"""π_ref scored per step (Gymnasium's reward, the default) or once at the episode's end (the collectors' fast path).

Both give every token the same log π_ref and reward: the end-of-episode pass is one teacher-forced forward over
the finished episode, the step path one cached forward per token (other kernels: |Δ| <= 1e-5 in fp32).
"""

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from textgym.episodes import collect_episodes, make_episode_envs
from textgym.policies import LMSampler
from textgym.ring_decoder import make_decoder

TOL = 1e-5


class StopAt:
    """Wraps a sampler: slot i emits ``stop_id`` at its step ``stop[i]`` (None: never forced)."""

    def __init__(self, inner, stop, stop_id):
        self.inner, self.stop, self.stop_id, self.t = inner, stop, stop_id, 0

    def reset(self):
        self.inner.reset()
        self.t = 0

    def act(self, obs):
        a, lp = self.inner.act(obs)
        for i, s in enumerate(self.stop):
            if s == self.t:
                a[i] = self.stop_id
        self.t += 1
        return a, lp


def both_ways(envs, make_policy, seed=0, **kwargs):
    """The same seeded episodes collected with π_ref scored per step and at each episode's end."""
    out = {}
    for mode in ("step", "episode"):
        out[mode] = collect_episodes(envs, make_policy(), seed=seed, reference_scoring=mode, **kwargs)
    return out["step"], out["episode"]


def assert_same_episodes(a, b):
    """Same tokens and results; per-token log π_ref and rewards to TOL (0 on padding in both)."""
    assert torch.equal(a["action"], b["action"]) and torch.equal(a["mask"], b["mask"])
    for key in ("rm_score", "score_reward", "missing_eos_penalty", "response_length", "length_capped"):
        assert torch.equal(a[key], b[key]), key
    torch.testing.assert_close(a["gold_score"], b["gold_score"], equal_nan=True, atol=0, rtol=0)
    assert list(a["response"]) == list(b["response"]) and list(a["prompt"]) == list(b["prompt"])
    for key in ("ref_logprob", "env_reward"):
        assert (a[key] - b[key]).abs().max() <= TOL, (key, (a[key] - b[key]).abs().max())
        assert not b[key][~b["mask"]].any()


def test_the_collector_scores_pi_ref_at_the_end_with_stops_and_the_cap_as_stepping_does():
    envs = make_episode_envs("TextRLHF-v0", 4, max_new_tokens=8)
    base = envs.unwrapped

    def policy():  # slot 0 stops at once, slot 2 at its 5th token, slots 1 and 3 run to the cap
        inner = LMSampler.for_env(base.model, envs, generator=torch.Generator().manual_seed(0))
        return StopAt(inner, [0, None, 4, None], base.eos_token_id)

    a, b = both_ways(envs, policy)
    assert a["response_length"].tolist()[0] == 1 and a["response_length"].tolist()[2] == 5
    assert a["length_capped"].tolist() == [False, True, False, True]
    assert_same_episodes(a, b)
    assert base.reference_scoring == "step"  # the env's own setting is back
    # the episode path's return is the reward contract's: score + β·Σ log π_ref
    ret = (b["env_reward"].double() * b["mask"]).sum(1)
    kl_part = base.kl_coef * (b["ref_logprob"].double() * b["mask"]).sum(1)
    expected = b["score_reward"] - b["missing_eos_penalty"] + kl_part
    torch.testing.assert_close(ret, expected, atol=1e-5, rtol=0)


def test_more_episodes_ending_at_once_than_one_teacher_forced_group_are_each_scored_as_stepping_does():
    """π_ref scores the finished episodes in groups of 64 rows: with 70 ending on one step, the engine's redesign
    indexed the second group's log-probs by the row's place in the batch (IndexError); each row has its own now."""
    envs = make_episode_envs("TextRLHF-v0", 70, max_new_tokens=3)
    base = envs.unwrapped

    def policy():  # every slot runs to the cap: all 70 episodes end on the same step
        return LMSampler.for_env(base.model, envs, generator=torch.Generator().manual_seed(1))

    a, b = both_ways(envs, policy)
    assert a["length_capped"].all() and len(set(a["prompt"])) > 1
    assert_same_episodes(a, b)


def test_the_collector_runs_no_cached_pi_ref_forward_by_default():
    envs = make_episode_envs("TextRLHF-v0", 3, max_new_tokens=5)
    base = envs.unwrapped
    calls = []
    step = base._engine.decoder.step
    base._engine.decoder.step = lambda tokens: calls.append(1) or step(tokens)
    collect_episodes(envs, LMSampler.for_env(base.model, envs, seed=0), seed=0)
    assert calls == [] and base._engine.decoder.cache is None  # no prefill, no step
    collect_episodes(envs, LMSampler.for_env(base.model, envs, seed=0), seed=0, reference_scoring="step")
    assert len(calls) >= 4


def test_a_missing_eos_penalty_lands_on_the_last_token_either_way():
    envs = make_episode_envs("TextRLHF-v0", 2, max_new_tokens=4, missing_eos_penalty=0.7, kl_coef=0.2)
    base = envs.unwrapped
    a, b = both_ways(envs, lambda: LMSampler.for_env(base.model, envs, generator=torch.Generator().manual_seed(1)))
    assert_same_episodes(a, b)
    capped = b["length_capped"]
    penalty = b["missing_eos_penalty"]
    assert capped.any() and torch.equal(penalty[capped], torch.full_like(penalty[capped], 0.7))
    assert not penalty[~capped].any()
    # issue 43.3: the column before the rename (−penalty) stays for one version
    assert torch.equal(b["eos_penalty"], -penalty) and torch.equal(a["eos_penalty"], -a["missing_eos_penalty"])


def test_the_policy_autocast_region_leaves_pi_ref_and_the_reward_model_in_fp32():
    envs = make_episode_envs("TextRLHF-v0", 3, max_new_tokens=6)
    base = envs.unwrapped

    def policy():
        return LMSampler.for_env(base.model, envs, generator=torch.Generator().manual_seed(2))

    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    for mode in ("step", "episode"):
        plain = collect_episodes(envs, policy(), seed=0, reference_scoring=mode)
        mixed = collect_episodes(envs, policy(), seed=0, reference_scoring=mode, autocast=bf16)
        m = plain["mask"] & mixed["mask"]
        same = (plain["action"] == mixed["action"]) & m  # bf16 sampling may pick other tokens later on
        first = same.cumprod(1).bool()  # the tokens before the first difference share their whole prefix
        assert first.sum() >= 3
        assert (plain["ref_logprob"] - mixed["ref_logprob"])[first].abs().max() <= TOL, mode


def test_stepping_by_hand_keeps_the_per_step_reward_bit_for_bit():
    env = gym.make("TextRLHF-v0", max_new_tokens=6)
    base = env.unwrapped
    assert base.reference_scoring == "step"  # gym.make's default
    obs, _ = env.reset(seed=0, options={"prompt": "The movie was"})
    # an independent cached decode of π_ref over the same tokens, in the env's kind of cache: the same bits
    decoder = make_decoder("auto", base.model, 1, obs["input_ids"].shape[0])
    P = base.max_prompt_tokens
    ids, mask = torch.as_tensor(obs["input_ids"][None, :P]), torch.as_tensor(obs["attention_mask"][None, :P])
    logits = decoder.prefill(torch.tensor([0]), ids[:, -int(mask.sum()) :], mask[:, -int(mask.sum()) :])
    rng = np.random.default_rng(0)
    for _ in range(6):
        action = int(rng.integers(3, base.tokenizer.vocab_size))
        expected = float(logits[0, action] - torch.logsumexp(logits[0], -1))
        obs, reward, terminated, truncated, info = env.step(action)
        assert info["ref_logprob"] == expected
        if terminated:
            assert reward == base.kl_coef * info["ref_logprob"] + info["score_reward"] - info["missing_eos_penalty"]
            break
        assert reward == base.kl_coef * info["ref_logprob"]
        logits = decoder.step(torch.tensor([action]))
    assert terminated


def test_the_single_env_pays_the_same_return_at_the_end_and_names_each_tokens_part():
    env = gym.make("TextRLHF-v0", max_new_tokens=5, reference_scoring="episode")
    step_env = gym.make("TextRLHF-v0", max_new_tokens=5)
    actions = [17, 250, 31, 999, 44]
    results = []
    for e in (step_env, env):
        e.reset(seed=0, options={"prompt": "A film"})
        rewards, infos = [], []
        for a in actions:
            _, r, terminated, _, info = e.step(a)
            rewards.append(r)
            infos.append(info)
        assert terminated
        results.append((np.array(rewards), infos))
    (step_r, step_i), (ep_r, ep_i) = results
    assert all("ref_logprob" not in i for i in ep_i) and not ep_r[:-1].any()
    np.testing.assert_allclose(ep_r.sum(), step_r.sum(), atol=TOL, rtol=0)  # the same undiscounted return
    np.testing.assert_allclose(ep_i[-1]["token_rewards"], step_r, atol=TOL, rtol=0)
    np.testing.assert_allclose(ep_i[-1]["token_ref_logprobs"], [i["ref_logprob"] for i in step_i], atol=TOL, rtol=0)
    assert ep_i[-1]["rm_score"] == step_i[-1]["rm_score"]
    # issue 43.3: token_ prefixes an episode's per-token arrays; the old name stays for one version
    np.testing.assert_array_equal(ep_i[-1]["ref_logprobs"], ep_i[-1]["token_ref_logprobs"])


def test_an_env_scoring_at_the_end_passes_gymnasiums_checker():
    env = gym.make("TextRLHF-v0", max_new_tokens=4, reference_scoring="episode")
    check_env(env.unwrapped, skip_render_check=True)


def test_reference_scoring_is_checked_and_action_masks_need_the_step_path():
    with pytest.raises(ValueError, match=r"reference_scoring='batch' is not one of \('step', 'episode'\)"):
        gym.make("TextRLHF-v0", reference_scoring="batch")
    env = gym.make("TextRLHF-v0", max_new_tokens=4, action_mask_top_p=0.9)
    env.unwrapped.reference_scoring = "episode"
    env.reset(seed=0)
    with pytest.raises(RuntimeError, match="reference_scoring='step' with action_mask_top_p"):
        env.unwrapped.action_masks()
    env.unwrapped.reference_scoring = "step"  # the next episode
    env.reset(seed=0)
    assert env.unwrapped.action_masks().any()


def test_a_vector_env_mixing_both_ways_gives_each_slot_its_own():
    envs = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point",
                        autoreset_mode="disabled", max_new_tokens=3)  # fmt: skip
    base = envs.unwrapped
    envs.reset(seed=0, options={"prompt": "Good", "reset_mask": np.array([True, False])})
    base.reference_scoring = "episode"
    envs.reset(seed=0, options={"prompt": "Good", "reset_mask": np.array([False, True])})
    rewards = []
    for a in (40, 41, 42):
        _, r, terminated, _, info = envs.step(np.array([a, a]))
        rewards.append(r)
        assert info["_ref_logprob"].tolist() == [True, False]
    rewards = np.array(rewards)
    assert terminated.all() and info["_token_rewards"].tolist() == [False, True]
    np.testing.assert_allclose(info["token_rewards"][1], rewards[:, 0], atol=TOL, rtol=0)
    np.testing.assert_allclose(rewards[:, 0].sum(), rewards[:, 1].sum(), atol=TOL, rtol=0)


def test_the_collector_scores_per_step_for_an_env_whose_action_masks_read_pi_ref():
    """MaskablePPO's masks read π_ref's next-token distribution at every step, so such an env is stepped per step."""
    envs = make_episode_envs("TextRLHF-v0", 2, max_new_tokens=3, action_mask_top_p=0.9)
    base = envs.unwrapped

    class Masked:
        def __init__(self):
            self.inner = LMSampler.for_env(base.model, envs, seed=0)

        def reset(self):
            self.inner.reset()

        def act(self, obs):
            masks = torch.as_tensor(base.action_masks())  # what sb3-contrib's MaskablePPO asks every step
            actions = masks.float().argmax(-1)
            return actions, torch.zeros(len(actions))

    episodes = collect_episodes(envs, Masked(), seed=0)
    assert episodes["mask"].any() and base.reference_scoring == "step"
