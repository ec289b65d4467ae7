"""collect_episodes: the one episode loop — complete episodes, finished slots wait, exact bookkeeping."""

import gymnasium as gym
import pytest
import torch
from test_reference_scoring import StopAt

from textgym.episodes import collect_episodes
from textgym.models import response_logprobs
from textgym.policies import LMSampler


class Rewarding:
    """A partner that pays each turn 0.5·k - 0.5 (the first turn 0: a turn paid 0 must still be seen) and ends
    the conversation after its third answer."""

    def reset(self, seed: int, prompt: str):
        self.k = 0

    def reply(self, conversation):
        self.k += 1
        return f"answer {self.k}", 0.5 * self.k - 0.5, self.k >= 3


def make_envs(n=4, **kwargs):
    kwargs.setdefault("max_new_tokens", 6)
    return gym.make_vec("TextRLHF-v0", num_envs=n, vectorization_mode="vector_entry_point", autoreset_mode="disabled",
                        **kwargs)  # fmt: skip


def sampler(envs, seed=0):
    return LMSampler.for_env(envs.unwrapped.model, envs, generator=torch.Generator().manual_seed(seed))


def eos_at(inner, stop):
    """Wraps a sampler: slot i emits EOS (id 2) at its step ``stop[i]`` (None: never forced)."""
    return StopAt(inner, stop, 2)


def test_complete_episodes_with_the_reward_identity_and_exact_logprobs():
    envs = make_envs()
    base = envs.unwrapped
    ep = collect_episodes(envs, sampler(envs), seed=0)
    assert ep.batch_size == (4,)
    lengths = ep["mask"].sum(1)
    assert lengths.tolist() == ep["response_length"].tolist()
    # the env's return = score + β·Σ log π_ref (the reward contract), episode by episode
    ret = (ep["env_reward"].double() * ep["mask"]).sum(1)
    expected = ep["score_reward"] + base.kl_coef * (ep["ref_logprob"].double() * ep["mask"]).sum(1)
    torch.testing.assert_close(ret, expected, atol=1e-5, rtol=0)
    # the sampler's cached log-probs equal one teacher-forced forward over the finished sequences
    with torch.no_grad():
        tf, _ = response_logprobs(base.model, ep["input_ids"], ep["attention_mask"], base.max_prompt_tokens)
    m = ep["mask"]
    torch.testing.assert_close(tf[m], ep["sample_log_prob"][m], atol=1e-5, rtol=0)
    assert all(isinstance(r, str) for r in ep["response"])


def test_finished_slots_wait_and_each_episode_is_scored_once():
    calls = []

    def rm(prompts, responses):
        calls.append(len(responses))
        return [0.0] * len(responses)

    envs = make_envs(reward_model=rm, normalize_reward=False)
    ep = collect_episodes(envs, eos_at(sampler(envs), [0, 2, None, None]), seed=0)
    assert ep["response_length"].tolist() == [1, 3, 6, 6]
    assert ep["length_capped"].tolist() == [False, False, True, True]
    assert sum(calls) == 4  # no episode beyond one per slot was started, stepped or scored
    assert ep["action"][0, 0] == 2 and ep["mask"][0].tolist() == [True] + [False] * 5


def test_a_subset_of_slots_and_given_prompts_make_a_group():
    envs = make_envs()
    ep = collect_episodes(envs, sampler(envs), num_episodes=3, prompts=["The movie"] * 3, seed=0)
    assert ep.batch_size == (3,) and list(ep["prompt"]) == ["The movie"] * 3
    assert len(set(ep["response"])) > 1  # three samples on one prompt
    ep = collect_episodes(envs, sampler(envs), seed=1)  # then all four slots again
    assert ep.batch_size == (4,)
    for bad in (0, 5, 2.0):
        with pytest.raises(ValueError, match=rf"num_episodes={bad!r} must be an int in \[1, num_envs=4\]"):
            collect_episodes(envs, sampler(envs), num_episodes=bad)


def test_a_fresh_env_runs_fewer_episodes_than_slots():
    envs = make_envs()
    ep = collect_episodes(envs, sampler(envs), num_episodes=1, seed=0)
    assert ep.batch_size == (1,) and ep["response_length"][0] >= 1


def test_same_seed_same_episodes():
    envs = make_envs()
    a = collect_episodes(envs, sampler(envs, seed=3), seed=7)
    b = collect_episodes(envs, sampler(envs, seed=3), seed=7)
    assert torch.equal(a["action"], b["action"]) and list(a["prompt"]) == list(b["prompt"])


def test_refuses_an_auto_resetting_env():
    envs = gym.make_vec("TextRLHF-v0", num_envs=2, vectorization_mode="vector_entry_point")
    with pytest.raises(ValueError, match="autoreset_mode='disabled'"):
        collect_episodes(envs, sampler(envs))


def test_greedy_log_probs_and_kl_agree():
    """A greedy policy is deterministic: log π(a) = 0, so its KL to π_ref is −Σ log π_ref exactly."""
    envs = make_envs()
    greedy = LMSampler.for_env(envs.unwrapped.model, envs, temperature=0)
    ep = collect_episodes(envs, greedy, seed=0)
    assert (ep["sample_log_prob"] == 0).all()
    kl = ((ep["sample_log_prob"] - ep["ref_logprob"]) * ep["mask"]).sum(1)
    torch.testing.assert_close(kl, -(ep["ref_logprob"] * ep["mask"]).sum(1))
    assert (kl > 0).all()


def test_text_columns_are_lists_of_str_per_episode_and_a_plain_list_on_request():
    """Issue 42.13: ``td["response"]`` prints as ``LinkedList([...])``. It is tensordict's list subclass (an item
    assigned to it is written back into the TensorDict); the docs say so and name ``.get(key).tolist()``."""
    import json

    envs = make_envs(3)
    td = collect_episodes(envs, sampler(envs), seed=0)
    responses = td["response"]
    assert isinstance(responses, list) and len(responses) == 3 and all(isinstance(r, str) for r in responses)
    plain = td.get("response").tolist()
    assert type(plain) is list and plain == responses and json.loads(json.dumps(responses)) == plain
    assert td[1]["response"] == plain[1] and isinstance(td[1]["prompt"], str)
    responses[0] = "edited"  # the documented write-back
    assert td.get("response").tolist()[0] == "edited"


def test_a_conversations_turn_rewards_sit_on_each_turns_last_token():
    """``turn_reward``: what the partner paid each turn, on the turn's last token (env_reward mixes it with
    β·log π_ref and the score); ``turn_end`` marks those tokens, so a turn paid 0 is seen too."""
    envs = gym.make_vec("TextMultiTurn-v0", num_envs=3, vectorization_mode="vector_entry_point",
                        autoreset_mode="disabled", partner=Rewarding, max_turn_tokens=3, max_new_tokens=40)  # fmt: skip
    td = collect_episodes(envs, sampler(envs), seed=5)
    ends = td["turn_end"]
    assert torch.equal(td["turn_reward"].sum(1), td["turn_reward_sum"])
    assert torch.equal(ends.sum(1), td["turns"] - td["length_capped"].long())  # a turn cut by the cap is not paid
    assert td["mask"][ends].all()  # a turn ends on the policy's token ...
    after = torch.nn.functional.pad(td["mask"][:, 1:], (0, 1))
    assert not after[ends].any()  # ... and the partner's reply (or the episode's end) follows it
    assert not td["turn_reward"][~ends].any()
    first = td["turn_reward"][0][ends[0]]
    assert torch.equal(first, torch.tensor([0.0, 0.5, 1.0][: len(first)], dtype=torch.float64))
    single = collect_episodes(make_envs(2), sampler(make_envs(2)), seed=5)
    assert not single["turn_end"].any() and not single["turn_reward"].any()
